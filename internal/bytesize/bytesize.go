// Package bytesize writes byte counts as people read them: in the largest binary
// unit that divides them.
package bytesize

import "fmt"

// Format writes n as GiB, MiB or KiB when it is a whole multiple of one ("4 MiB"),
// else in bytes ("4097 B").
func Format(n int64) string {
	for _, u := range []struct {
		shift uint
		name  string
	}{{30, "GiB"}, {20, "MiB"}, {10, "KiB"}} {
		if n >= 1<<u.shift && n%(1<<u.shift) == 0 {
			return fmt.Sprintf("%d %s", n>>u.shift, u.name)
		}
	}
	return fmt.Sprintf("%d B", n)
}
