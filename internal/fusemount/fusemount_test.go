package fusemount

import (
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestParseMountinfo(t *testing.T) {
	in, ok := parseMountinfo(`46 27 0:40 / /tmp/a\040b/mnt rw,nosuid,nodev,relatime - fuse.odpemu odpemu:26796 rw,user_id=0,group_id=0`)
	assert.True(t, ok)
	assert.Equal(t, Info{Dir: "/tmp/a b/mnt", PID: 26796, Conn: 40}, in)
	in, ok = parseMountinfo(`36 25 0:45 / /mnt rw,relatime shared:1 - fuse.odpemu odpemu:12 rw`)
	assert.True(t, ok, "optional fields before the separator")
	assert.Equal(t, Info{Dir: "/mnt", PID: 12, Conn: 45}, in)
	for _, l := range []string{
		`46 27 0:40 / /mnt rw - fuse.sshfs odpemu:1 rw`,
		`46 27 0:40 / /mnt rw - fuse.odpemu other:1 rw`,
		`46 27 0:40 / /mnt rw - fuse.odpemu`,
		`garbage`, ``,
	} {
		_, ok := parseMountinfo(l)
		assert.False(t, ok, l)
	}
}

func TestServing(t *testing.T) {
	assert.True(t, serving(os.Getpid()))
	assert.False(t, serving(1<<30), "no such process")
}
