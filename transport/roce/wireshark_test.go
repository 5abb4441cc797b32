package roce

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/odpemu/odpemu/internal/capture"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// sender is an unconnected UDP socket with path MTU discovery on, bound to src: Linux
// sends its datagrams with DF set and an IP identification of zero, the IPv4 header
// the ICRC assumes (Endpoints).
func sender(t *testing.T, src string) *net.UDPConn {
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_MTU_DISCOVER, unix.IP_PMTUDISC_DO)
		})
		if err != nil {
			return err
		}
		return serr
	}}
	pc, err := lc.ListenPacket(context.Background(), "udp4", src)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pc.Close() })
	return pc.(*net.UDPConn)
}

// Wireshark's InfiniBand dissector decodes what Append writes as RRoCE: a capture on
// the loopback interface of a packet of every opcode shows each with its opcode and
// PSN, nothing malformed, the IPv4 header the ICRC assumes, and the ICRC computed
// here. The check needs tshark (Debian's tshark package; .ci/run installs it) and
// the right to capture.
func TestWiresharkDecodes(t *testing.T) {
	conn := sender(t, "127.0.0.1:0")
	local := conn.LocalAddr().(*net.UDPAddr).AddrPort()
	dst := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), UDPPort)
	ep := Endpoints{Src: netip.AddrPortFrom(local.Addr().Unmap(), local.Port()), Dst: dst}
	pkts := samples()

	filter := fmt.Sprintf("udp and src port %d and dst port %d", local.Port(), UDPPort)
	c := capture.Start(t, "lo", filter, len(pkts))
	var icrcs []uint32
	for _, p := range pkts {
		b, err := p.Append(nil, ep)
		require.NoError(t, err)
		icrcs = append(icrcs, ICRC(ep, b[:len(b)-ICRCSize]))
		_, err = conn.WriteToUDPAddrPort(b, dst)
		require.NoError(t, err)
	}
	require.NoError(t, c.Wait(time.Minute), "tshark exits after %d packets", len(pkts))

	// UDP port 4791 is RRoCE to Wireshark without being told. Its RPC-over-RDMA
	// heuristic would take the samples' SEND payloads for RPC messages (and call
	// them malformed): it is turned off, the InfiniBand dissector is what is checked.
	rows, err := c.Fields([]string{"--disable-protocol", "rpcordma"}, "frame.protocols", "infiniband.bth.opcode",
		"infiniband.bth.psn", "infiniband.invariant.crc", "ip.id", "ip.flags.df", "_ws.malformed", "_ws.expert.severity",
		"infiniband.deth.q_key", "infiniband.deth.srcqp", "infiniband.ieth")
	require.NoError(t, err)
	require.Len(t, rows, len(pkts))
	for i, f := range rows {
		require.Len(t, f, 11, "%q", f)
		p := pkts[i]
		assert.Contains(t, f[0], "infiniband", "%v: dissected as InfiniBand: %s", p.Opcode, f[0])
		assert.Equal(t, strconv.Itoa(int(p.Opcode)), f[1], "%v: opcode", p.Opcode)
		assert.Equal(t, strconv.Itoa(int(p.PSN)), f[2], "%v: PSN", p.Opcode)
		if p.Opcode == AtomicWrite && f[3] == "" {
			// IBTA 1.5's opcode: dissectors older than it show the BTH and stop.
			t.Logf("%v: this Wireshark decodes its BTH only", p.Opcode)
			continue
		}
		crc, err := strconv.ParseUint(strings.TrimPrefix(f[3], "0x"), 16, 32)
		require.NoError(t, err, "%v: an invariant CRC field: %q", p.Opcode, f[3])
		// Wireshark shows the four ICRC bytes as a big-endian number.
		var le [4]byte
		le[0], le[1], le[2], le[3] = byte(icrcs[i]), byte(icrcs[i]>>8), byte(icrcs[i]>>16), byte(icrcs[i]>>24)
		want := uint64(le[0])<<24 | uint64(le[1])<<16 | uint64(le[2])<<8 | uint64(le[3])
		assert.Equal(t, want, crc, "%v: the ICRC Wireshark finds is ours", p.Opcode)
		assert.Equal(t, "0x0000", f[4], "%v: IP identification zero", p.Opcode)
		assert.Contains(t, []string{"1", "True", "Set"}, f[5], "%v: DF set", p.Opcode)
		assert.Empty(t, f[6], "%v: malformed", p.Opcode)
		assert.NotContains(t, f[7], "error", "%v: expert errors", p.Opcode)
		if p.Opcode.UD() { // the DETH: Wireshark shows both fields as hexadecimal
			qkey, err := strconv.ParseUint(strings.TrimPrefix(f[8], "0x"), 16, 64)
			require.NoError(t, err, "%v: a Q_Key field: %q", p.Opcode, f[8])
			src, err := strconv.ParseUint(strings.TrimPrefix(f[9], "0x"), 16, 64)
			require.NoError(t, err, "%v: a source QP field: %q", p.Opcode, f[9])
			assert.Equal(t, [2]uint64{uint64(p.QKey), uint64(p.SrcQP)}, [2]uint64{qkey, src}, "%v: DETH", p.Opcode)
		}
		if p.Opcode.flags()&hasIETH != 0 { // the IETH's R_Key, as bytes (Wireshark lists the header and the field)
			for _, k := range strings.Split(f[10], ",") {
				assert.Equal(t, fmt.Sprintf("%08x", p.Imm), strings.ReplaceAll(k, ":", ""), "%v: IETH", p.Opcode)
			}
		}
	}
}
