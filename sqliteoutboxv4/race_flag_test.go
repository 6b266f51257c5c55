//go:build race

package sqliteoutboxv4_test

// raceEnabled reports whether the tests are built with -race.
const raceEnabled = true
