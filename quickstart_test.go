package inbox_test

import (
	"bytes"
	"context"
	"os"
	osexec "os/exec"
	"regexp"
	"strings"
	"testing"
	"time"
)

// The quick start's program (_examples/quickstart, which go test ./... does
// not enter) prints what the README says it prints: the code spans of the
// README's sentence that begins "The first prints" are lines of its output,
// in order, and the last two are its last two lines. A UUID the README
// shortens to "95cbe405-…" matches any UUID. The program runs with go run,
// from the module's source, so README, example and library cannot drift
// apart; it needs no server.
func TestQuickstart_printsWhatTheREADMEQuotes(t *testing.T) {
	t.Parallel()
	quoted := readmeQuickstartLines(t)
	if len(quoted) < 2 {
		t.Fatalf("README.md: want at least two quoted lines in the sentence \"The first prints ...\", got %q", quoted)
	}

	goTool, err := osexec.LookPath("go")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("the go command is not on PATH: %v", err)
		}
		t.Skipf("runs the quick start with the go command, which is not on PATH: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute) // a bound, not a measurement
	defer cancel()
	args := []string{"run"}
	if raceEnabled {
		args = append(args, "-race") // reuses the packages this test binary was built from
	}
	cmd := osexec.CommandContext(ctx, goTool, append(args, "./_examples/quickstart")...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go run ./_examples/quickstart: %v\n%s%s", err, out, stderr.Bytes())
	}
	printed := strings.Split(strings.TrimRight(string(out), "\n"), "\n")

	next := 0 // quoted lines appear in the output in order
	for _, q := range quoted {
		re := quotedLinePattern(q)
		for next < len(printed) && !re.MatchString(printed[next]) {
			next++
		}
		if next == len(printed) {
			t.Fatalf("README.md quotes %q, which the quick start does not print (after the lines matched before it); it printed:\n%s", q, out)
		}
		next++
	}
	for i, q := range quoted[len(quoted)-2:] {
		last := printed[len(printed)-2+i]
		if !quotedLinePattern(q).MatchString(last) {
			t.Errorf("README.md says the output ends with %q, but line %d of %d is %q", q, len(printed)-1+i, len(printed), last)
		}
	}
}

// readmeQuickstartLines returns the code spans of README.md's sentence
// that begins "The first prints" (it ends at the first ". ").
func readmeQuickstartLines(t *testing.T) []string {
	t.Helper()
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(readme), "\nThe first prints")
	if !ok {
		t.Fatal(`README.md: no paragraph beginning "The first prints" under the quick start`)
	}
	paragraph, _, _ := strings.Cut(rest, "\n\n")
	sentence, _, _ := strings.Cut(strings.ReplaceAll(paragraph, "\n", " ")+" ", ". ")
	var spans []string
	for _, m := range regexp.MustCompile("`([^`]+)`").FindAllStringSubmatch(sentence, -1) {
		spans = append(spans, m[1])
	}
	return spans
}

// shortUUID is how the README shortens a message UUID: its first group and
// an ellipsis.
var shortUUID = regexp.MustCompile(`[0-9a-f]{8}-…`)

// quotedLinePattern matches an output line equal to the README's quote q,
// with any UUID where q has a shortened one.
func quotedLinePattern(q string) *regexp.Regexp {
	parts := shortUUID.Split(q, -1)
	for i, p := range parts {
		parts[i] = regexp.QuoteMeta(p)
	}
	return regexp.MustCompile(`^` + strings.Join(parts, `[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}`) + `$`)
}
