package bytesize

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestFormat(t *testing.T) {
	for n, want := range map[int64]string{0: "0 B", 1000: "1000 B", 4096: "4 KiB", 4097: "4097 B", 3 << 20: "3 MiB",
		1 << 30: "1 GiB", 1536 << 20: "1536 MiB", 5 << 40: "5120 GiB"} {
		assert.Equal(t, want, Format(n), "%d", n)
	}
}
