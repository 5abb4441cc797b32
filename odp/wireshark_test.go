package odp

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"testing"

	"github.com/odpemu/odpemu/internal/capture"
	"github.com/odpemu/odpemu/transport/roce"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A short run between two QPs over UDP, captured on the loopback interface, as
// Wireshark's InfiniBand dissector sees it: every frame is RRoCE, nothing is
// malformed, opcodes and PSNs are those odpemu's decoder reads from the same bytes,
// and every ICRC is right for the IP and UDP headers the packet really had. The run
// covers multi-packet WRITE and READ at a 1024-byte MTU, SEND and WRITE with
// immediate, both atomics, ACKs and the RNR NAK of an ODP fault.
func TestWiresharkDecodesARun(t *testing.T) {
	a, b := newNode(t, Config{}), newNode(t, Config{})
	// Both Links on RoCEv2's port, which Wireshark knows, on addresses of their own.
	server := netip.MustParseAddrPort("127.0.0.4:4791")
	client := netip.MustParseAddrPort("127.0.0.5:4791")
	connectUDP(t, a.qp, b.qp, UDPConfig{Addr: client, MTU: 1024}, UDPConfig{Addr: server, MTU: 1024})
	live := capture.StartLive(t, "lo", "udp and host 127.0.0.5", []string{"--disable-protocol", "rpcordma"},
		"frame.protocols", "infiniband.bth.opcode", "infiniband.bth.psn", "ip.src", "udp.srcport", "ip.dst", "udp.dstport",
		"ip.id", "udp.payload", "_ws.malformed", "_ws.expert.severity")

	src, smr := a.region(t, 64<<10, rwa)
	fill(src, 1)
	_, dmr := b.region(t, 64<<10, rwa|AccessOnDemand) // the first WRITE faults: RNR NAK
	_, brecv := b.region(t, 4096, rwa)
	require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 1, SGL: sge(brecv, 0, 4096)}))
	require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 2, SGL: sge(brecv, 0, 4096)}))
	for _, wr := range []SendWR{
		write(smr, 0, 8192, dmr, 0),
		read(smr, 16<<10, 8192, dmr, 0),
		{Opcode: OpSendImm, Imm: 5, SGL: sge(smr, 0, 100)},
		{Opcode: OpRDMAWriteImm, Imm: 6, SGL: sge(smr, 0, 64), RemoteAddr: dmr.Addr() + 32<<10, RKey: dmr.RKey()},
		fetchAdd(smr, 40<<10, dmr, 64),
		{Opcode: OpAtomicCmpSwap, CompareAdd: 1, Swap: 2, SGL: sge(smr, 48<<10, 8), RemoteAddr: dmr.Addr() + 64, RKey: dmr.RKey()},
	} {
		wc := a.post(t, wr)
		require.Equal(t, WCSuccess, wc.Status, "%v: %s", wr.Opcode, wc.Detail)
	}
	// The marker: a datagram after everything else, to a port that is not RoCEv2's.
	marker, err := net.DialUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 5)}, &net.UDPAddr{IP: net.IPv4(127, 0, 0, 5), Port: 9})
	require.NoError(t, err)
	defer func() { _ = marker.Close() }() // sent its one datagram
	_, err = marker.Write([]byte("end of the run"))
	require.NoError(t, err)
	var rows [][]string
	for {
		f, err := live.Next()
		require.NoError(t, err)
		if len(f) == 11 && f[6] == "9" {
			break
		}
		rows = append(rows, f)
	}
	seen := map[roce.Opcode]int{}
	for i, f := range rows {
		require.Len(t, f, 11, "frame %d: %q", i, f)
		assert.Contains(t, f[0], "infiniband", "frame %d: dissected as InfiniBand: %s", i, f[0])
		assert.Empty(t, f[9], "frame %d: malformed", i)
		assert.NotContains(t, f[10], "error", "frame %d: expert errors", i)
		assert.Equal(t, "0x0000", f[7], "frame %d: IP identification zero", i)
		payload, err := hex.DecodeString(f[8])
		require.NoError(t, err)
		sport, _ := strconv.Atoi(f[4])
		dport, _ := strconv.Atoi(f[6])
		ep := roce.Endpoints{Src: netip.AddrPortFrom(netip.MustParseAddr(f[3]), uint16(sport)),
			Dst: netip.AddrPortFrom(netip.MustParseAddr(f[5]), uint16(dport))}
		require.GreaterOrEqual(t, len(payload), roce.BTHSize+roce.ICRCSize)
		n := len(payload) - roce.ICRCSize
		assert.Equal(t, roce.ICRC(ep, payload[:n]), binary.LittleEndian.Uint32(payload[n:]), "frame %d: ICRC", i)
		p, err := roce.Decode(payload, ep, roce.Limits{MTU: 1024, MaxMessage: 1 << 20})
		require.NoError(t, err, "frame %d", i)
		assert.Equal(t, strconv.Itoa(int(p.Opcode)), f[1], "frame %d: opcode", i)
		assert.Equal(t, strconv.Itoa(int(p.PSN)), f[2], "frame %d: PSN", i)
		if p.Opcode == roce.Acknowledge && p.Syndrome.Kind() == 1 {
			seen[0xff]++ // an RNR NAK
		}
		seen[p.Opcode]++
	}
	for _, op := range []roce.Opcode{roce.WriteFirst, roce.WriteMiddle, roce.WriteLast, roce.ReadRequest,
		roce.ReadRespFirst, roce.ReadRespMiddle, roce.ReadRespLast, roce.SendOnlyImm, roce.WriteOnlyImm,
		roce.FetchAdd, roce.CompareSwap, roce.AtomicAck, roce.Acknowledge} {
		assert.Positive(t, seen[op], "no %v in the capture", op)
	}
	assert.Positive(t, seen[0xff], "no RNR NAK in the capture")
	t.Logf("%d frames: %s", len(rows), fmt.Sprint(seen))
}
