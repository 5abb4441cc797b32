package odp_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"unsafe"

	"github.com/odpemu/odpemu/odp"
)

// host is one side of a connection in the examples.
type host struct {
	dev *odp.Device
	pd  *odp.PD
	cq  *odp.CQ
	qp  *odp.QP
}

// connected opens two devices and connects a QP on each (error handling is the
// examples' own business: they panic).
func connected() (client, server host) {
	open := func(name string) host {
		d, err := odp.Open(odp.Config{Name: name})
		if err != nil {
			panic(err)
		}
		pd, _ := d.AllocPD()
		cq, _ := d.CreateCQ(64)
		qp, _ := pd.CreateQP(odp.QPConfig{SendCQ: cq, RecvCQ: cq})
		return host{d, pd, cq, qp}
	}
	client, server = open("client"), open("server")
	if err := odp.ConnectLoopback(client.qp, server.qp); err != nil {
		panic(err)
	}
	return client, server
}

func (h host) close() { _ = h.dev.Close() }

// post posts a signaled work request and waits for its completion.
func (h host) post(wr odp.SendWR) odp.WC {
	wr.Flags |= odp.SendSignaled
	if err := h.qp.PostSend(wr); err != nil {
		panic(err)
	}
	var wc [1]odp.WC
	if _, err := h.cq.Wait(context.Background(), wc[:]); err != nil {
		panic(err)
	}
	return wc[0]
}

const rwa = odp.AccessLocalWrite | odp.AccessRemoteWrite | odp.AccessRemoteRead | odp.AccessRemoteAtomic

// Atomics on an ODP MR: fetch-and-add and compare-and-swap on an 8-byte aligned word;
// the value found lands in the requester's 8-byte SGE.
func ExampleQP_PostSend_atomics() {
	client, server := connected()
	defer client.close()
	defer server.close()
	counter, _ := server.dev.Alloc(4096)
	rmr, _ := server.pd.RegMR(counter, rwa|odp.AccessOnDemand)
	result, _ := client.dev.Alloc(4096)
	lmr, _ := client.pd.RegMR(result, rwa)
	sge := []odp.SGE{{Addr: lmr.Addr(), Length: 8, LKey: lmr.LKey()}}

	wc := client.post(odp.SendWR{Opcode: odp.OpAtomicFetchAdd, SGL: sge, RemoteAddr: rmr.Addr(), RKey: rmr.RKey(), CompareAdd: 5})
	fmt.Println(wc.Status, "found", binary.NativeEndian.Uint64(result), "now", binary.NativeEndian.Uint64(counter))
	wc = client.post(odp.SendWR{Opcode: odp.OpAtomicCmpSwap, SGL: sge, RemoteAddr: rmr.Addr(), RKey: rmr.RKey(), CompareAdd: 5, Swap: 42})
	fmt.Println(wc.Status, "found", binary.NativeEndian.Uint64(result), "now", binary.NativeEndian.Uint64(counter))
	wc = client.post(odp.SendWR{Opcode: odp.OpAtomicFetchAdd, SGL: sge, RemoteAddr: rmr.Addr() + 4, RKey: rmr.RKey(), CompareAdd: 1})
	fmt.Println(wc.Status)
	// Output:
	// success found 0 now 5
	// success found 5 now 42
	// remote invalid request error
}

// RDMA WRITE with immediate: the data lands, then a receive is consumed and its
// completion carries the immediate.
func ExampleQP_PostSend_immediate() {
	client, server := connected()
	defer client.close()
	defer server.close()
	dst, _ := server.dev.Alloc(4096)
	dmr, _ := server.pd.RegMR(dst, rwa|odp.AccessOnDemand)
	src := []byte("with immediate")
	smr, _ := client.pd.RegMR(src, 0)
	_ = server.qp.PostRecv(odp.RecvWR{WRID: 7})

	client.post(odp.SendWR{Opcode: odp.OpRDMAWriteImm, Imm: 0xc0ffee, RemoteAddr: dmr.Addr(), RKey: dmr.RKey(),
		SGL: []odp.SGE{{Addr: smr.Addr(), Length: uint32(len(src)), LKey: smr.LKey()}}})
	var wc [1]odp.WC
	_, _ = server.cq.Wait(context.Background(), wc[:])
	fmt.Printf("%s: %d bytes, immediate %#x: %s\n", wc[0].Status, wc[0].ByteLen, wc[0].ImmData, dst[:len(src)])
	// Output:
	// success: 14 bytes, immediate 0xc0ffee: with immediate
}

// A responder's ODP fault is answered with RNR NAK, as on mlx5: with the default
// rnr_retry (7, retry for ever) a WRITE into cold memory succeeds after the RNR
// timer; with rnr_retry = 0 it fails.
func ExampleQP_ModifyAttr() {
	client, server := connected()
	defer client.close()
	defer server.close()
	dst, _ := server.dev.Alloc(1 << 20)
	dmr, _ := server.pd.RegMR(dst, rwa|odp.AccessOnDemand)
	src := make([]byte, 4096)
	smr, _ := client.pd.RegMR(src, 0)
	wr := odp.SendWR{Opcode: odp.OpRDMAWrite, RemoteAddr: dmr.Addr() + 512<<10, RKey: dmr.RKey(),
		SGL: []odp.SGE{{Addr: smr.Addr(), Length: 4096, LKey: smr.LKey()}}}

	fmt.Println("default:", odp.DefaultQPAttr.RNRRetry, "retries, RNR timer", odp.RNRTimer(odp.DefaultQPAttr.MinRNRTimer))
	wc := client.post(wr)
	// The responder answers RNR NAK while the fault runs (once, or again if the
	// retransmission comes before the fault is resolved).
	fmt.Println(wc.Status, "after RNR NAKs:", client.qp.Stats().RNRNaksReceived > 0)

	_ = server.dev.Invalidate(dmr.Addr(), dmr.Len()) // cold again
	_ = client.qp.ModifyAttr(odp.QPAttr{RNRRetry: 0}, odp.AttrRNRRetry)
	fmt.Println(client.post(wr).Status)
	// Output:
	// default: 7 retries, RNR timer 640µs
	// success after RNR NAKs: true
	// RNR retry counter exceeded
}

// Implicit ODP: one key for the whole address space, with a synchronous prefetch of
// the range about to be used.
func ExamplePD_RegImplicitMR() {
	client, server := connected()
	defer client.close()
	defer server.close()
	imr, _ := server.pd.RegImplicitMR(rwa)
	buf, _ := server.dev.Alloc(64 << 10) // allocated after the registration: covered too
	addr := uint64(uintptrOf(buf))
	err := server.pd.AdviseMR(odp.AdvisePrefetchWrite, odp.AdviseFlush, []odp.SGE{{Addr: addr, Length: 64 << 10, LKey: imr.LKey()}})
	fmt.Println(err, server.dev.Stats().PagesPrefetched, "pages prefetched")

	src := []byte("implicit")
	smr, _ := client.pd.RegMR(src, 0)
	wc := client.post(odp.SendWR{Opcode: odp.OpRDMAWrite, RemoteAddr: addr + 100, RKey: imr.RKey(),
		SGL: []odp.SGE{{Addr: smr.Addr(), Length: uint32(len(src)), LKey: smr.LKey()}}})
	fmt.Println(wc.Status, string(buf[100:108]), "network page faults:", server.dev.Stats().PageFaults)
	caps := server.dev.QueryDevice().ODP
	fmt.Println(caps.General&odp.ODPSupportImplicit != 0, caps.RC&odp.ODPAtomic != 0)
	// Output:
	// <nil> 16 pages prefetched
	// success implicit network page faults: 0
	// true true
}

// Two devices of one process share its address space: a buffer registers on both,
// and one invalidation clears both devices' entries.
func Example_twoDevices() {
	a, _ := odp.Open(odp.Config{Name: "nic0"})
	defer func() { _ = a.Close() }()
	b, _ := odp.Open(odp.Config{Name: "nic1"})
	defer func() { _ = b.Close() }()
	apd, _ := a.AllocPD()
	bpd, _ := b.AllocPD()
	buf, _ := a.Alloc(8 << 10)
	buf[0], buf[4096] = 1, 1 // present: both registrations map them
	amr, _ := apd.RegMR(buf, rwa|odp.AccessOnDemand)
	bmr, _ := bpd.RegMR(buf, rwa|odp.AccessOnDemand)
	fmt.Println(amr.Stats().ValidPages, bmr.Stats().ValidPages)
	_ = b.Invalidate(bmr.Addr(), bmr.Len())
	fmt.Println(amr.Stats().ValidPages, bmr.Stats().ValidPages)
	// Output:
	// 2 2
	// 0 0
}

func uintptrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }
