//go:build race

package core

// raceEnabled reports whether the race detector is on (it reserves
// terabytes of address space and slows everything several times).
const raceEnabled = true
