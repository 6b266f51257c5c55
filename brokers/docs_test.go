//go:build unix

package brokers

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestDocs_snippetsAreTestCode guards docs/brokers.md: each of its Go
// snippets is a contiguous excerpt of this package's tests (compared line
// by line, without indentation or blank lines), so the page shows code that
// these tests run.
func TestDocs_snippetsAreTestCode(t *testing.T) {
	if os.Getenv(workerEnv) != "" {
		t.Skip("worker process")
	}
	doc, err := os.ReadFile(filepath.Join("..", "docs", "brokers.md"))
	if err != nil {
		t.Fatal(err)
	}
	files, err := filepath.Glob("*_test.go")
	if err != nil {
		t.Fatal(err)
	}
	var code []string
	for _, f := range files {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		code = append(append(code, codeLines(string(src))...), "\x00") // no excerpt spans two files
	}
	blocks := regexp.MustCompile("(?s)```go\n(.*?)```").FindAllStringSubmatch(string(doc), -1)
	if len(blocks) == 0 {
		t.Fatal("no Go snippet in docs/brokers.md")
	}
	for i, b := range blocks {
		want := codeLines(b[1])
		found := false
		for at := range code {
			if at+len(want) <= len(code) && slices.Equal(code[at:at+len(want)], want) {
				found = true
				break
			}
		}
		if !found {
			t.Errorf("docs/brokers.md: Go snippet %d of %d, starting %q, is not in this package's tests", i+1, len(blocks), want[0])
		}
	}
}

// codeLines returns the lines of src without indentation, blank ones left out.
func codeLines(src string) []string {
	var lines []string
	for l := range strings.Lines(src) {
		if l = strings.TrimSpace(l); l != "" {
			lines = append(lines, l)
		}
	}
	return lines
}
