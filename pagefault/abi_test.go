package pagefault

import (
	"encoding/binary"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestABIMatchesHeader(t *testing.T) {
	for _, v := range headerABI() {
		if v.header == 0 {
			t.Logf("%s: not in the installed header, ours %#x", v.name, v.ours)
			continue
		}
		assert.Equal(t, v.header, v.ours, v.name)
	}
}

// The numbers _IOWR gives, written out: they also cover ioctls newer than the
// installed header.
func TestIoctlNumbersFromIOWR(t *testing.T) {
	want := map[string][2]uintptr{
		"API": {ioctlAPI, 0xc018aa3f}, "REGISTER": {ioctlRegister, 0xc020aa00},
		"UNREGISTER": {ioctlUnregister, 0x8010aa01}, "WAKE": {ioctlWake, 0x8010aa02},
		"COPY": {ioctlCopy, 0xc028aa03}, "ZEROPAGE": {ioctlZeropage, 0xc020aa04},
		"MOVE": {ioctlMove, 0xc028aa05}, "WRITEPROTECT": {ioctlWriteprotect, 0xc018aa06},
		"CONTINUE": {ioctlContinue, 0xc020aa07}, "POISON": {ioctlPoison, 0xc020aa08},
	}
	for name, v := range want {
		assert.Equal(t, v[1], v[0], name)
	}
	assert.EqualValues(t, 40, unsafe.Sizeof(uffdioMove{}))
	assert.EqualValues(t, 32, unsafe.Sizeof(uffdioPoison{}))
}

func TestDecodeMsg(t *testing.T) {
	var b [MsgSize]byte
	put := func(off int, v uint64) {
		for i := 0; i < 8; i++ {
			b[off+i] = byte(v >> (8 * i))
		}
	}
	b[0] = byte(EventPagefault)
	put(8, PagefaultFlagWrite)
	put(16, 0x7f0000001000)
	put(24, 4242)
	m, err := DecodeMsg(b[:])
	assert.NoError(t, err)
	assert.Equal(t, Msg{Event: EventPagefault, Flags: PagefaultFlagWrite, Address: 0x7f0000001000, ThreadID: 4242}, m)

	b[0] = byte(EventRemove)
	put(8, 0x1000)
	put(16, 0x3000)
	m, err = DecodeMsg(b[:])
	assert.NoError(t, err)
	assert.Equal(t, Msg{Event: EventRemove, Start: 0x1000, End: 0x3000}, m)

	b[0] = byte(EventRemap)
	put(24, 0x2000)
	m, err = DecodeMsg(b[:])
	assert.NoError(t, err)
	assert.Equal(t, Msg{Event: EventRemap, From: 0x1000, To: 0x3000, Len: 0x2000}, m)

	_, err = DecodeMsg(b[:31])
	assert.ErrorIs(t, err, ErrShortMsg)
	b[0] = 0x99
	_, err = DecodeMsg(b[:])
	assert.Error(t, err)
}

func TestFeatureString(t *testing.T) {
	assert.Equal(t, "none", Feature(0).String())
	assert.Equal(t, "EVENT_REMOVE|MOVE", (FeatureEventRemove | FeatureMove).String())
	assert.Equal(t, "0x100000", Feature(1<<20).String())
}

func TestPagemapScanABI(t *testing.T) {
	// _IOWR('f', 16, struct pm_scan_arg) with the 96-byte struct of <linux/fs.h>.
	assert.EqualValues(t, 96, unsafe.Sizeof(pmScanArg{}))
	assert.EqualValues(t, 24, unsafe.Sizeof(PageRegion{}))
	assert.EqualValues(t, uintptr(0xc0606610), ioctlPagemapScan)
}

// The fault server queues its own evictions under the code Go decodes as EventEvict,
// with the layout of a REMOVE.
func TestEventEvictMatchesServer(t *testing.T) {
	assert.EqualValues(t, eventEvictC, EventEvict)
	b := make([]byte, MsgSize)
	b[msgOffEvent] = byte(EventEvict)
	binary.NativeEndian.PutUint64(b[msgOffArg:], 0x1000)
	binary.NativeEndian.PutUint64(b[msgOffArg+8:], 0x3000)
	m, err := DecodeMsg(b)
	require.NoError(t, err)
	assert.Equal(t, Msg{Event: EventEvict, Start: 0x1000, End: 0x3000}, m)
}
