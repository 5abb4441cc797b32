//go:build !race

package odp

// raceDetector says the race detector is on: its runtime's memory counts in the
// process's resident set.
const raceDetector = false
