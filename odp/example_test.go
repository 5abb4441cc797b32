package odp_test

import (
	"context"
	"fmt"

	"github.com/odpemu/odpemu/odp"
)

// Two emulated NICs in one process: the server exposes a region registered on demand,
// the client writes into it from a pinned region. The server's pages are faulted in by
// the NIC when the WRITE arrives.
func Example() {
	client, _ := odp.Open(odp.Config{})
	defer func() { _ = client.Close() }() // an example keeps its teardown short
	server, _ := odp.Open(odp.Config{})
	defer func() { _ = server.Close() }()

	cpd, _ := client.AllocPD()
	spd, _ := server.AllocPD()
	ccq, _ := client.CreateCQ(16)
	scq, _ := server.CreateCQ(16)
	cqp, _ := cpd.CreateQP(odp.QPConfig{SendCQ: ccq, RecvCQ: ccq})
	sqp, _ := spd.CreateQP(odp.QPConfig{SendCQ: scq, RecvCQ: scq})
	if err := odp.ConnectLoopback(cqp, sqp); err != nil {
		panic(err)
	}

	// Pinned: any memory; every page is faulted in and locked now.
	src := []byte("hello, on-demand paging")
	smr, err := cpd.RegMR(src, 0)
	if err != nil {
		panic(err)
	}
	// On demand: memory from Alloc; nothing is touched or pinned now.
	dst, _ := server.Alloc(1 << 20)
	dmr, err := spd.RegMR(dst, odp.AccessLocalWrite|odp.AccessRemoteWrite|odp.AccessOnDemand)
	if err != nil {
		panic(err)
	}
	fmt.Println("valid pages before:", dmr.Stats().ValidPages)

	err = cqp.PostSend(odp.SendWR{WRID: 1, Opcode: odp.OpRDMAWrite, Flags: odp.SendSignaled,
		SGL:        []odp.SGE{{Addr: smr.Addr(), Length: uint32(len(src)), LKey: smr.LKey()}},
		RemoteAddr: dmr.Addr() + 4096, RKey: dmr.RKey()})
	if err != nil {
		panic(err)
	}
	var wc [1]odp.WC
	if _, err := ccq.Wait(context.Background(), wc[:]); err != nil {
		panic(err)
	}
	fmt.Println(wc[0].Status)
	fmt.Println(string(dst[4096 : 4096+len(src)]))
	st := dmr.Stats()
	fmt.Println("network page faults:", st.PageFaults, "pages mapped:", st.PagesFaulted)
	// Output:
	// valid pages before: 0
	// success
	// hello, on-demand paging
	// network page faults: 1 pages mapped: 16
}
