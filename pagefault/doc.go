// Package pagefault binds userfaultfd(2) and builds odpemu's fault machinery on it: a
// resolver that makes page ranges present from a page source with ioctls (the NIC's
// network page fault path, which never takes a CPU fault), and a CPU fault server that
// serves application threads touching on-demand memory without needing a Go P.
//
// Only memory that odpemu mmaps itself may be registered for missing-page faults,
// never the Go heap; any anonymous memory may be registered for events only (ModeWP
// with nothing write-protected), which leaves its faults to the kernel.
//
// # Why CPU faults are served by a C thread
//
// A page fault is a CPU trap, not a system call. A goroutine that touches a missing
// page of a userfaultfd-registered range blocks its OS thread in the kernel while it
// still holds its P: the scheduler does not know the thread is blocked, sysmon does not
// hand the P off (it does that for system calls only), and asynchronous preemption
// cannot interrupt a thread that sleeps in the kernel. A fault inside copy() or any
// other assembly routine is not even at a preemption point. So if the code that serves
// the fault needs a P, and every P is held by a goroutine blocked in a fault, nothing
// runs; and a stop-the-world (garbage collection, a panic's stack dump) waits for the
// faulting goroutines forever. Measured on 2-vCPU machines, a fault server in a
// goroutine took 25 ms per fault at GOMAXPROCS=1 and up to 0.9 s with eight faulting
// goroutines at GOMAXPROCS=2.
//
// The design avoids the hazard in three ways:
//  1. The emulated NIC never takes a CPU fault on on-demand memory: it checks its own
//     translation table before every DMA and resolves a miss with ioctls (UFFDIO_COPY,
//     UFFDIO_ZEROPAGE; EEXIST means present), the way hardware takes a network page
//     fault instead of a CPU fault.
//  2. Faults that application goroutines take are served by CPUServer, a pthread
//     started through cgo that reads the userfaultfd and installs pages from memory
//     prepared in C. It never waits for Go: it holds no Go pointer, calls no Go code
//     and takes no lock that Go code holds while it could fault.
//  3. No goroutine hands a registered page to a system call that holds a kernel lock
//     while it reads or writes user memory (write(2) holds the file's inode lock while
//     it copies): if the page were missing, the syscall would fault with the lock held,
//     and the server thread may need the same lock (it writes evicted pages to the
//     store file and reads them back). Such data is first copied, in user mode, to
//     memory of our own.
//
// # Paged regions: the page states
//
// A paged region is memory that the pager (package invalidate) may evict to a store or
// migrate to new frames. Each page has a 32-bit state shared by the server thread (S)
// and the Go pager (E: the evictor, which runs one at a time, inside an invalidation
// of the page's range, so the NIC neither maps nor DMAs to the page meanwhile). Every
// change is a compare-and-swap (CAS) or an exchange on that word, so each actor sees
// the other's claims. Content moves between three places: the page itself, the page's
// private bounce page (in a stash mapping registered on the same userfaultfd, so that
// UFFDIO_MOVE can move into it), and the store (a memfd or file, at a fixed offset).
//
//	state        meaning
//	NONE         normal: content in place (or missing, then a fault zero-fills)
//	EVICTING     E claimed the page and is moving it out (to the bounce, then store)
//	STORED       content in the store only; the page is missing
//	RECLAIMED    S took an EVICTING page back; content in place or still in bounce
//	INSTALLING   S is zero-filling the page (a fault, its fault-around, or an install
//	             request): E must not start
//	DISCARDED    a REMOVE (madvise DONTNEED) hit an EVICTING/RECLAIMED page: it reads
//	             as zero; its bounce page may hold stale content that E drops
//	REMAPPED     a REMAP (mremap) hit an EVICTING/RECLAIMED page: its bounce content
//	             belongs to the new address; S moves it there, then marks it GONE
//	GONE         unmapped (UNMAP): the address may be someone else's memory now
//	REMOVING     a REMOVE was read while the page was NONE (or claimed by E, which
//	             then moved nothing out): the kernel zaps it only after the read, so
//	             what is in place may be discarded content; E never claims it
//	DIRECT       S claimed the page for its own direct reclaim (below) and is moving
//	             it to the store; a claim distinct from EVICTING, so that E's final
//	             CAS can never settle it
//
// The transitions, by actor and mechanism:
//
//	actor  from        to          how
//	E      NONE        EVICTING    CAS, then UFFDIO_ZEROPAGE must answer EEXIST (the page
//	                               is present and ours, not someone's new mapping;
//	                               else back to NONE). Claimed first, probed after:
//	                               S's direct reclaim may store a NONE page meanwhile
//	E      EVICTING    STORED      UFFDIO_MOVE page->bounce, copy bounce to a buffer;
//	                               under the store lock, if still EVICTING, write it
//	                               to the store, then CAS
//	E      EVICTING    NONE        CAS, when the move moved nothing (page was missing)
//	E      RECLAIMED   EVICTING    CAS (putBack re-claims), then UFFDIO_MOVE
//	                               bounce->page, then CAS EVICTING->NONE, all inside
//	                               the DMA gate (below)
//	E      EVICTING    NONE        migration: UFFDIO_COPY bounce->page (a new frame),
//	                               then CAS, inside the DMA gate
//	E      STORED      NONE        Restore (before a range stops being paged): if still
//	                               STORED, UFFDIO_COPY from the store's content inside
//	                               the DMA gate; then CAS and punch (Unstore)
//	E      DISCARDED   NONE        MADV_DONTNEED on the bounce page, then CAS
//	E      DISCARDED   REMOVING    CAS, when the claim moved nothing out (settleEmpty):
//	                               the content in place awaits the REMOVE's zap
//	S      EVICTING    RECLAIMED   CAS on a fault or install, then UFFDIO_MOVE
//	                               bounce->page; on success CAS RECLAIMED->NONE
//	S      STORED      NONE        pread store, UFFDIO_COPY page, CAS; the offset is
//	                               queued for E to punch (under the store lock, unless
//	                               the page is STORED again by then)
//	S      NONE        DIRECT      CAS, for direct reclaim: a present, evictable page
//	S      DIRECT      STORED      under the store lock: allocate the store's page,
//	                               UFFDIO_MOVE page->scratch, write it, store STORED
//	S      DIRECT      NONE        when the move or the write failed (the page is put
//	                               back first)
//	S      NONE        INSTALLING  CAS before every zero-fill (the faulting page, each
//	                               page of its fault-around, an install request);
//	                               back to NONE after the UFFDIO_COPY. A page found
//	                               NONE and filled unclaimed could be moved out by E
//	                               in between: E would store its content under the
//	                               zero page. A CAS that finds E's claim instead makes
//	                               S restore the page after all
//	S      STORED      NONE        CAS when the store cannot give the content back
//	                               (counted as an error; the page reads as zero)
//	S      STORED      NONE        on REMOVE (the content is discarded): CAS, punch
//	S      NONE        REMOVING    on REMOVE: CAS (the zap follows the read; an evictor
//	                               that claimed the page first could store content the
//	                               application discarded, which a fault would restore)
//	S      REMOVING    NONE        CAS after a fault or an install found the page
//	                               missing and filled it: the zap has passed it
//	S      EVICTING,   DISCARDED   on REMOVE: CAS (the old content must not return)
//	       RECLAIMED
//	S      any but     GONE        on UNMAP: CAS loop; a STORED copy is punched
//	       REMAPPED
//	S      STORED      NONE        on REMAP: content read from the store, queued to be
//	                               installed at the new address (UFFDIO_COPY)
//	S      EVICTING,   REMAPPED    on REMAP: CAS; queued UFFDIO_MOVE bounce->new
//	       RECLAIMED               address (a hole if E had not moved it), then
//	                               CAS REMAPPED->GONE
//
// Direct reclaim. With a budget (CPUServer.SetBudget), S evicts before an install
// would take the resident estimate past it, as the kernel's reclaim runs in the
// faulting thread when a memory cgroup is at its limit: application threads blocked
// in faults may hold every P, so a Go reclaimer could not be relied on to run. S
// picks present, evictable pages (PagedRegion.SetEvictable: registered for missing
// faults, not mlocked) from its own hand, closes the DMA gate and waits for DMA in
// flight (at most 50 microseconds: a DMA may wait for the fault being served), moves a
// batch of pages out (UFFDIO_MOVE into a scratch area registered on the userfaultfd),
// writes them to the store, queues an EventEvict per run and counts it in
// Gate.Events, and only then opens the gate: the NIC drops its translations before
// any DMA trusts them, as for a REMOVE. S cannot MADV_DONTNEED a registered range
// (it would wait for its own event), so the scratch area leaves the userfaultfd for
// that madvise and joins it again. When it finds nothing to evict in time it installs
// past the budget and counts the pages (Overshoot); if Go's evictor only took its
// victims first, the next install tries again. A UFFDIO_MOVE that reports failure is
// checked against the page tables, by S and by E alike: Linux 6.18 was seen to move a
// page and report EEXIST (a move retried inside the kernel that met its own result),
// and a page taken for still in place while it sat in the scratch area was lost when
// the area was dropped. The store lock is a C mutex that
// only threads running C code hold (Go takes it inside one cgo call), so S never
// waits for a goroutine there.
//
// Rules that follow: S waits for E only before it reads an event, for a put-back E
// makes inside the DMA gate (below), which is one ioctl that never waits for S; E
// waits for S only through ioctls that return EAGAIN (retried, outside the gate) while
// an event is pending, and at the gate while S reads. A page in DISCARDED, REMAPPED or
// GONE never gets its old content back at its old address: S treats DISCARDED as
// "zero-fill" and the others as "not mapped here". A RECLAIMED or REMAPPED page's
// bounce page is never dropped while it may hold the only copy of the content.
// Whenever E's final CAS fails, it re-reads the state and acts on what an event or a
// fault made of the page (putBack and settleEmpty in package paging).
//
// E puts old content back into place (putBack, a migration's copy, Restore) only
// inside the DMA gate, entered as a DMA: S reads no event between E's look at the
// state and its ioctl. A discard zaps only after its REMOVE is read, so one read
// before E looked has marked the page and E puts nothing back, and one read after
// zaps what E put back. Outside the gate, a REMOVE read and its zap could fall between
// the look and the ioctl, and the application would read its discarded content after
// madvise returned (for good, from Restore). The one exception is a read with DMA in
// flight (undrained, below); E re-checks the state after the ioctl for it and takes
// the content out again.
//
// # The DMA gate: the kernel's order for the application's own changes
//
// The kernel runs an MMU notifier before a page's translation changes, and the change
// waits for it; userfaultfd instead sends an event and lets the thread that caused it
// go on once the event is read. The gate (Gate, shared between the server thread and
// the NIC) turns that into the kernel's order:
//
//	step  who          what
//	1     NIC (Go)     Enter: wait while the gate is closed, count itself in flight
//	2     NIC          wait until the events read so far are applied (invalidate.Pump)
//	3     NIC          check its translation table, copy, leave (Exit); a miss
//	                   leaves first and takes the network page fault outside
//	4     server (C)   before every read(2): close the gate, wait for DMAs in flight
//	5     server       read; count each event it read in Gate.Events; open the gate
//	6     pump (Go)    apply the events: invalidate the NIC's entries of their ranges
//	                   (REMOVE, UNMAP and REMAP ranges stay unusable: gone)
//
// So no DMA overlaps the change an event releases: MADV_DONTNEED zaps its pages only
// after its event is read (step 5), and a thread that unmapped a range cannot map new
// memory there before its UNMAP is read. And no DMA that starts after the read trusts
// a translation the change withdrew (step 2). Closing is fair: a closed gate admits
// no new DMA, and a DMA is one copy of at most 256 KiB (package odp), so the reader
// waits for one copy at most.
//
// Three details make it hold.
//   - MADV_DONTNEED zaps after its event was read and the kernel says nothing when it
//     is done, so a NIC fault right after step 6 could map a page just before it is
//     zapped. ZapBarrier narrows that to a gap (its doc; package odp's latezap.go
//     handles what comes through it): the pump runs it inside the invalidation of each
//     batch's REMOVE ranges, while NIC faults on them are held off. It waits until
//     UFFDIO_ZEROPAGE stops failing with EAGAIN (the woken thread has run) and then
//     takes the mmap lock for writing (mprotect of a page of its own), which the
//     zapping thread holds for reading.
//   - While an event waits to be read, the kernel refuses every install (EAGAIN). A
//     DMA in flight that faults (only possible if a zap still overlapped it) would
//     wait for the server, and the server for the DMA. The server therefore looks at
//     the fault count in the userfaultfd's fdinfo while it drains, reads waiting
//     faults (read(2) returns faults before events), and if those cannot be served
//     because an event waits, reads the event with the DMA still in flight. That is
//     counted (CPUServerStats.Undrained); package odp then sees the copy's fault in
//     the fault ring and makes the copy again (a torn DMA), so nothing torn reaches
//     the wire or stays in memory.
//   - munmap and mremap change the mapping before their event exists. A DMA that
//     starts on such a page in between either still reaches the old page (its TLB
//     entry is not flushed yet) or faults: an access error, never a write elsewhere,
//     since the thread that unmapped cannot map anew before its event is read.
//
// What stays out of reach: another thread that maps memory into a hole the moment
// munmap made it, before the unmapping thread's event is read, while a DMA that
// started before the munmap still copies there; and fork, whose write-protection of
// the parent's pages also precedes its event (the audit reports such DMAs).
//
// # Other shared state
//
// The server also keeps a ring of recent faults it served (for torn-DMA checks and the
// audit), mirrored in Gate.FaultSeq so that a DMA during which nothing faulted needs
// no cgo call to know it, a queue of
// non-pagefault events for Go (Events, with the time each was read), and a queue of
// install requests from Go (Install), each answered on an eventfd. Region slots are
// added and removed under the server's region lock, which the server thread also
// holds while it works on a batch, so that a removed region's state words are never
// read after Remove returns.
package pagefault
