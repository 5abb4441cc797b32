// CPU fault server: a pthread that reads a userfaultfd and resolves the faults that
// application threads take on on-demand memory, so that no Go P is needed to serve them
// (doc.go explains why, and holds the table of page states and their transitions).
// Non-pagefault events are queued in C memory and announced on an eventfd; the thread
// never blocks on Go.
#ifndef ODPEMU_CPUSERVER_H
#define ODPEMU_CPUSERVER_H

#include <stdint.h>
#include <pthread.h>

typedef struct odp_fs_stats {
	uint64_t faults;       // pagefault messages served
	uint64_t write_faults; // of which write faults
	uint64_t pages;        // pages installed (including fault-around and install requests)
	uint64_t exist;        // faults found already resolved (EEXIST), woken
	uint64_t retries;      // EAGAIN retries (event pending)
	uint64_t errors;       // faults that could not be resolved (range gone), woken
	uint64_t events;       // non-pagefault events queued for Go (odp_gate.events)
	uint64_t service_ns;   // sum over faults of read-to-resolved time
	uint64_t max_service_ns;
	uint64_t drains;       // reads that waited for DMA in flight to drain first
	uint64_t drain_ns;     // sum of those waits
	uint64_t max_drain_ns;
	uint64_t fault_reads;  // reads of waiting faults while DMA was still in flight
	uint64_t undrained;    // events that such a read returned all the same (see doc.go)
	uint64_t reclaims;     // direct reclaims: installs that found the budget exhausted
	uint64_t evicted;      // pages the server evicted to the store (direct reclaim)
	uint64_t overshoot;    // pages installed past the budget: no victim could be evicted
	                       // in time (none evictable, or DMA in flight did not drain)
} odp_fs_stats;

// The DMA gate: the kernel's order between the application's mapping changes and the
// emulated NIC's DMA. The kernel releases the thread that raised a REMOVE, UNMAP or
// REMAP event once the event is read; before every read(2) the server thread closes the
// gate (no DMA may start) and waits until no DMA is in flight, so that no DMA overlaps
// the change an event releases, and counts each event in events before it opens the
// gate again, so that a DMA that starts later sees the event before it trusts a
// translation (doc.go has the whole protocol). Both words are futex words; Go enters
// and leaves with atomic operations on them.
typedef struct odp_gate {
	int32_t closed;     // 0 open; 1 closed; 2 closed with DMAs waiting (futex word)
	int32_t inflight;   // DMAs admitted and not yet done (futex word)
	uint64_t events;    // non-pagefault events read so far
	uint64_t fault_seq; // sequence of the last fault served (see odp_fs_faulted_since)
} odp_gate;

// odp_gate_alloc allocates a zeroed gate; the caller frees it with odp_gate_free once
// the server using it has stopped and nothing reads it any more.
odp_gate *odp_gate_alloc(void);
void odp_gate_free(odp_gate *g);

typedef struct odp_fs odp_fs;

// Page states of a paged region (see odp_fs_add_region; doc.go has the transitions).
enum {
	ODP_PAGE_NONE = 0,      // a fault zero-fills
	ODP_PAGE_STORED = 1,    // the content is in the store
	ODP_PAGE_EVICTING = 2,  // the evictor is moving the page to its bounce page
	ODP_PAGE_RECLAIMED = 3, // a fault took an evicting page back from the bounce page
	ODP_PAGE_GONE = 4,      // unmapped: the address may belong to someone else now
	ODP_PAGE_INSTALLING = 5, // the server thread is zero-filling it: not to be evicted
	ODP_PAGE_DISCARDED = 6, // discarded (REMOVE) while evicting: reads as zero; its
	                        // bounce page may hold stale content for the evictor to drop
	ODP_PAGE_REMAPPED = 7,  // mremapped away while evicting: its bounce page's content
	                        // belongs to the new address, where the server moves it
	ODP_PAGE_REMOVING = 8,  // a REMOVE (madvise DONTNEED) was read while it was NONE:
	                        // its zap may still be pending, so its content (if still
	                        // present) is discarded content that must never be evicted
	ODP_PAGE_DIRECT = 9,    // the server thread is moving it to the store itself
	                        // (direct reclaim): a claim of its own, distinct from the
	                        // Go evictor's EVICTING, so neither settles the other's
};

// odp_fs_start starts a server on uffd with gate as its DMA gate. around is the number
// of pages installed per fault (the faulting page plus around-1 following ones, when
// missing). It returns NULL and sets *err to an errno on failure.
odp_fs *odp_fs_start(int uffd, unsigned around, odp_gate *gate, int *err);
// odp_fs_stop stops the thread, joins it, leaves the gate open and frees the server
// (not the gate).
void odp_fs_stop(odp_fs *fs);
void odp_fs_stats_read(odp_fs *fs, odp_fs_stats *out);
// odp_fs_event_fd is an eventfd that is readable while events are queued.
int odp_fs_event_fd(odp_fs *fs);
// odp_fs_pop_events moves up to max queued 32-byte uffd_msg records into out, and the
// CLOCK_MONOTONIC times at which they were read into times, and returns how many.
int odp_fs_pop_events(odp_fs *fs, void *out, uint64_t *times, int max);
// odp_fs_reading_word returns the word that is 1 while the server is between reading
// messages and queueing them (the gate's events count the ones queued): Go reads it
// atomically, without a call (CPUServer.SettledEvents). Valid until odp_fs_stop.
int *odp_fs_reading_word(odp_fs *fs);
// odp_fs_fault_seq returns the sequence number of the latest fault served (a page a
// thread found missing: installed, found installed meanwhile, or not mappable).
uint64_t odp_fs_fault_seq(odp_fs *fs);
// odp_fs_faulted_since reports 1 if a fault served after sequence since overlapped
// [lo, hi), or if that can no longer be told; 0 otherwise.
int odp_fs_faulted_since(odp_fs *fs, uint64_t since, uint64_t lo, uint64_t hi);
// odp_fs_set_store sets the file descriptor of the store that STORED pages are read
// from. Call before adding regions.
int odp_fs_set_store(odp_fs *fs, int fd);
// Reference words of a paged region's pages (CLOCK's access bits).
enum {
	ODP_REF_CLEAR = 0, // not accessed since the hand passed
	ODP_REF_SET = 1,   // accessed (an install, a CPU fault, the NIC's DMA): a second chance
	ODP_REF_HELD = 2,  // installed for the NIC's fault, which has not mapped it yet:
	                   // the server's direct reclaim leaves it alone until then (Go
	                   // turns it SET once mapped); the Go pager's CLOCK clears it
	                   // like a set bit
};

// odp_region_alloc allocates the zeroed words of a region of npages pages: its state
// words (ODP_PAGE_*), then its reference words (ODP_REF_*), then its evictable flags
// (odp_fs_set_evictable), npages each; odp_region_free frees them. The caller owns them: it frees them only once the
// region is removed (or the server stopped) and no caller can read them any more.
uint32_t *odp_region_alloc(uint64_t npages);
void odp_region_free(uint32_t *state);
// odp_fs_add_region makes [base, base+npages pages) a paged region whose page i
// bounces at bounce + i*ps and is stored at store_off + i*ps, with state as its state
// words (read and written atomically by both sides). It returns the region's slot, or
// -1 when the table is full.
int odp_fs_add_region(odp_fs *fs, uint64_t base, uint64_t npages, uint64_t bounce, uint64_t store_off, uint32_t *state);
// odp_fs_remove_region retires the region in slot if it still has these state words;
// once it returns, the server thread does not touch them again.
void odp_fs_remove_region(odp_fs *fs, int slot, uint32_t *state);
// odp_fs_pop_punches moves up to max store offsets whose copy the server no longer
// needs (restored or discarded pages) into out and returns how many; one consumer.
int odp_fs_pop_punches(odp_fs *fs, uint64_t *out, int max);
// odp_fs_restored counts pages the server restored from the store or a bounce page.
uint64_t odp_fs_restored(odp_fs *fs);
// Answers to an install request, written to its done_fd.
enum {
	ODP_INSTALL_DONE = 1,     // every page is present
	ODP_INSTALL_UNMAPPED = 2, // some page is not in a registered range
	ODP_INSTALL_STOPPED = 3,  // the server stopped before it was served
};

// odp_fs_install asks the server thread to make npages pages at start present (as
// faults would: restored if evicted, zero-filled otherwise) and to write 1 to done_fd
// when it has. The thread is then the only installer of paged memory.
int odp_fs_install(odp_fs *fs, uint64_t start, uint64_t npages, int done_fd);
// An event the server itself queues (not a kernel code): it evicted [start, end) of
// a paged region (arg.remove's layout); the NIC's translations of it must go before a
// DMA trusts them, as for a REMOVE.
#define ODP_EVENT_EVICT 0xe0

// Direct reclaim. With a budget (pages; 0: none), the server evicts pages of paged
// regions to the store before an install would take the resident estimate past it:
// the application's own CPU faults are bounded as the NIC's are, without waiting for
// Go (which may have no P to run on while application threads are blocked in faults).
void odp_fs_set_budget(odp_fs *fs, int64_t pages);
// The resident estimate: pages present in paged regions. The server adds its installs
// and subtracts its evictions; Go adds what it installs or evicts itself, and replaces
// it with the kernel's count (odp_fs_set_resident).
int64_t odp_fs_resident(odp_fs *fs);
void odp_fs_add_resident(odp_fs *fs, int64_t delta);
void odp_fs_set_resident(odp_fs *fs, int64_t pages);
// odp_fs_set_evictable says whether pages [first, first+n) of the region in slot
// (if it still has these state words) may be evicted by the server: only pages whose
// range is registered for missing faults (or a later access would not fault) and not
// mlocked. A region's pages start not evictable. Once it returns, no eviction that
// decided otherwise is still running.
void odp_fs_set_evictable(odp_fs *fs, int slot, uint32_t *state, uint64_t first, uint64_t n, int on);
// odp_fs_unstore changes *word from STORED to NONE and punches the store at off if it
// did, under the store lock; it returns 1 if it did.
int odp_fs_unstore(odp_fs *fs, uint32_t *word, uint64_t off);
// odp_fs_store_evicted writes the page at buf to the store at off and changes *word
// from EVICTING to STORED, under the store lock, if *word is still EVICTING (the Go
// evictor's claim); it returns 1 if it did, 0 if the claim was lost (a fault took the
// page back), -1 if the write failed.
int odp_fs_store_evicted(odp_fs *fs, uint32_t *word, uint64_t off, const void *buf);
// odp_fs_punch_unless_stored punches the store at off unless *word is STORED, under
// the store lock (so that no eviction writes the page's copy in between).
void odp_fs_punch_unless_stored(odp_fs *fs, uint32_t *word, uint64_t off);

// odp_fs_now_ns reads CLOCK_MONOTONIC, the clock of the event times.
uint64_t odp_fs_now_ns(void);

#endif
