//go:build race

package sqliteoutbox_test

// raceEnabled reports whether the tests are built with -race.
const raceEnabled = true
