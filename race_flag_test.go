//go:build race

package inbox_test

// raceEnabled reports whether the tests are built with -race.
const raceEnabled = true
