#define _GNU_SOURCE
#include "cpuserver.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#define MSG_BATCH 64
// While DMA drains before a read, the server looks this often for faults waiting to be
// read: a DMA may itself be blocked in a fault (see gate_drain).
#define DRAIN_POLL_NS 100000

#ifndef UFFDIO_MOVE
struct uffdio_move {
	__u64 dst;
	__u64 src;
	__u64 len;
	__u64 mode;
	__s64 move;
};
#define UFFDIO_MOVE _IOWR(UFFDIO, 0x05, struct uffdio_move)
#endif
#ifndef UFFDIO_MOVE_MODE_ALLOW_SRC_HOLES
#define UFFDIO_MOVE_MODE_ALLOW_SRC_HOLES ((__u64)1 << 1)
#endif
#define MAX_PENDING 4096
#define RING 4096

#define MAX_REGIONS 256
#define PUNCH_RING 8192
// Direct reclaim evicts at most this many pages at once (an eighth of the budget, at
// least one): the scratch area holds as many pages.
#define EVICT_BATCH 64
// How long direct reclaim waits for DMA in flight to drain before it gives up: a
// DMA is one copy of at most 256 KiB (tens of microseconds), unless the goroutine
// doing it has no P to run on, which waiting longer would not change.
#define EVICT_DRAIN_NS 50000
#define EVICT_POLL_NS 10000

// A paged region: memory whose pages the emulator may evict to a store or migrate.
// state[i] is one of ODP_PAGE_*; bounce + i*ps is page i's private bounce page in a
// stash mapping registered on the same userfaultfd; the store holds page i at
// store_off + i*ps.
typedef struct region {
	uint64_t base, npages, bounce;
	uint32_t *state;
	uint32_t *ref;       // reference bits (CLOCK): set by installs and the NIC's accesses
	uint32_t *evictable; // 1: the server may evict page i (set by Go: odp_fs_set_evictable)
	uint64_t store_off;
	int used;
} region;

// A request from Go to make pages present, served by the server thread so that it
// is the only installer of paged memory (see odp_fs_install).
typedef struct install_req {
	uint64_t next, end; // pages still to install: [next, end)
	int done_fd;        // eventfd written when the request is finished: 1, or 2 if
	                    // a page could not be installed (not registered)
	int failed;
	struct install_req *link;
} install_req;

typedef struct queued {
	struct uffd_msg m;
	uint64_t t_ns; // CLOCK_MONOTONIC when the message was read
} queued;

struct odp_fs {
	int uffd;
	int fdinfo; // /proc/self/fdinfo/<uffd>, for the count of faults waiting; -1 if none
	odp_gate *gate;
	int stopfd;
	int evfd;
	unsigned around;
	long ps;
	void *zero; // read-only zero mapping of around pages
	pthread_t thread;

	pthread_mutex_t qmu; // protects the event queue below
	queued *q;
	int qhead, qlen, qcap;

	odp_fs_stats st; // updated with __atomic builtins, read by odp_fs_stats_read
	int reading;     // 1 from before read(2) until its events are queued

	pthread_mutex_t imu; // protects the install request list
	install_req *ihead, *itail;
	int ifd;             // eventfd: install requests queued

	pthread_mutex_t rmu; // protects regions' slots being added and removed
	region regions[MAX_REGIONS];
	int store_fd;        // -1 until set
	char *bounce_buf;    // one page, the server thread's pread buffer
	uint64_t restored;   // pages restored from the store or a bounce page

	// Store offsets whose copy is no longer needed, for the evictor to punch: the
	// server thread never punches itself (the evictor is the store's only writer, and
	// a punch racing a new eviction of the same page would delete its content).
	uint64_t punch[PUNCH_RING];
	uint64_t punch_head, punch_tail; // producer: server thread; consumer: Go
	uint64_t punch_dropped;          // offsets lost to a full ring (punched with the region)

	// Direct reclaim (see make_room): the resident estimate of paged regions and the
	// budget, in pages (budget 0: none); both read and written atomically, by Go too.
	int64_t resident, budget;
	uint64_t hand_slot, hand_page; // where the next victim search starts
	uint64_t reclaim_idle;         // installs to let pass before reclaim tries again
	int pagemap;                   // /proc/self/pagemap, -1 if it cannot be opened
	char *scratch;                 // EVICT_BATCH pages registered on uffd: evicted pages
	                               // move here on their way to the store; NULL if unusable
	char *scratch_map;             // the scratch mapping, unmapped by odp_fs_stop
	// store_mu orders the store's writes with its punches: the server thread's evictions
	// (write, then STORED) against Go's punches (state check or STORED->NONE, then
	// punch). Only threads running C code hold it (Go takes it inside a cgo call), so
	// the server never waits for a goroutine here.
	pthread_mutex_t store_mu;

	// Ring of recent faults served, for torn-DMA checks and audits: entry seq%RING
	// holds fault seq; gate->fault_seq mirrors ring_seq for a check without cgo.
	uint64_t ring_seq;
	struct { uint64_t seq, start, end; } ring[RING];
};

static uint64_t now_ns(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void add(uint64_t *p, uint64_t v) { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
static int64_t resident_add(odp_fs *fs, int64_t d) { return __atomic_add_fetch(&fs->resident, d, __ATOMIC_SEQ_CST); }

// queue_punch asks the evictor to punch the store page at off.
static void queue_punch(odp_fs *fs, uint64_t off) {
	uint64_t h = __atomic_load_n(&fs->punch_head, __ATOMIC_RELAXED);
	if (h - __atomic_load_n(&fs->punch_tail, __ATOMIC_ACQUIRE) >= PUNCH_RING) {
		add(&fs->punch_dropped, 1);
		return;
	}
	fs->punch[h % PUNCH_RING] = off;
	__atomic_store_n(&fs->punch_head, h + 1, __ATOMIC_RELEASE);
}

int odp_fs_pop_punches(odp_fs *fs, uint64_t *out, int max) {
	uint64_t t = __atomic_load_n(&fs->punch_tail, __ATOMIC_RELAXED);
	uint64_t h = __atomic_load_n(&fs->punch_head, __ATOMIC_ACQUIRE);
	int n = 0;
	for (; t < h && n < max; t++)
		out[n++] = fs->punch[t % PUNCH_RING];
	__atomic_store_n(&fs->punch_tail, t, __ATOMIC_RELEASE);
	return n;
}

static void queue_event(odp_fs *fs, const struct uffd_msg *m, uint64_t t) {
	pthread_mutex_lock(&fs->qmu);
	if (fs->qlen == fs->qcap) {
		int ncap = fs->qcap ? fs->qcap * 2 : 64;
		queued *nq = malloc(sizeof(*nq) * (size_t)ncap);
		if (nq == NULL) { // keep the event by spinning on memory: never drop it
			pthread_mutex_unlock(&fs->qmu);
			sched_yield();
			queue_event(fs, m, t);
			return;
		}
		for (int i = 0; i < fs->qlen; i++)
			nq[i] = fs->q[(fs->qhead + i) % fs->qcap];
		free(fs->q);
		fs->q = nq;
		fs->qhead = 0;
		fs->qcap = ncap;
	}
	fs->q[(fs->qhead + fs->qlen) % fs->qcap] = (queued){*m, t};
	fs->qlen++;
	pthread_mutex_unlock(&fs->qmu);
	uint64_t one = 1;
	ssize_t w = write(fs->evfd, &one, sizeof one);
	(void)w;
	__atomic_fetch_add(&fs->gate->events, 1, __ATOMIC_SEQ_CST); // before the gate opens
}

int odp_fs_pop_events(odp_fs *fs, void *out, uint64_t *times, int max) {
	struct uffd_msg *o = out;
	pthread_mutex_lock(&fs->qmu);
	int n = 0;
	while (n < max && fs->qlen > 0) {
		times[n] = fs->q[fs->qhead].t_ns;
		o[n++] = fs->q[fs->qhead].m;
		fs->qhead = (fs->qhead + 1) % fs->qcap;
		fs->qlen--;
	}
	if (fs->qlen == 0) {
		uint64_t v;
		ssize_t r = read(fs->evfd, &v, sizeof v); // drain the doorbell
		(void)r;
	}
	pthread_mutex_unlock(&fs->qmu);
	return n;
}

// record notes that a fault on [start, end) was served: the range was found missing by
// some thread. Entries are written before the ring sequence is published, so a reader
// that sees seq s finds entry s complete unless it has been overwritten since (its seq
// then differs).
static void record(odp_fs *fs, uint64_t start, uint64_t end) {
	uint64_t s = __atomic_load_n(&fs->ring_seq, __ATOMIC_RELAXED) + 1;
	int i = (int)(s % RING);
	__atomic_store_n(&fs->ring[i].seq, 0, __ATOMIC_RELEASE);
	fs->ring[i].start = start;
	fs->ring[i].end = end;
	__atomic_store_n(&fs->ring[i].seq, s, __ATOMIC_RELEASE);
	__atomic_store_n(&fs->ring_seq, s, __ATOMIC_RELEASE);
	__atomic_store_n(&fs->gate->fault_seq, s, __ATOMIC_SEQ_CST);
}

uint64_t odp_fs_fault_seq(odp_fs *fs) { return __atomic_load_n(&fs->ring_seq, __ATOMIC_ACQUIRE); }

int odp_fs_faulted_since(odp_fs *fs, uint64_t since, uint64_t lo, uint64_t hi) {
	uint64_t now = __atomic_load_n(&fs->ring_seq, __ATOMIC_ACQUIRE);
	if (now - since >= RING)
		return 1; // too many to tell: assume the worst
	for (uint64_t s = since + 1; s <= now; s++) {
		int i = (int)(s % RING);
		uint64_t a = fs->ring[i].start, b = fs->ring[i].end;
		if (__atomic_load_n(&fs->ring[i].seq, __ATOMIC_ACQUIRE) != s)
			return 1; // overwritten while reading
		if (a < hi && lo < b)
			return 1;
	}
	return 0;
}

static void wake(odp_fs *fs, uint64_t page) {
	struct uffdio_range r = {.start = page, .len = (uint64_t)fs->ps};
	ioctl(fs->uffd, UFFDIO_WAKE, &r);
}

// note_time adds d to a sum of durations and raises their maximum to d if lower.
// Only the server thread writes either.
static void note_time(uint64_t *sum, uint64_t *maxd, uint64_t d) {
	add(sum, d);
	if (d > __atomic_load_n(maxd, __ATOMIC_RELAXED))
		__atomic_store_n(maxd, d, __ATOMIC_RELAXED);
}

static void account(odp_fs *fs, uint64_t t0) { note_time(&fs->st.service_ns, &fs->st.max_service_ns, now_ns() - t0); }

// find returns the region holding page and its index, or NULL. Regions are only
// removed after their memory is unregistered, so no fault can be in them then.
static region *find(odp_fs *fs, uint64_t page, uint64_t *idx) {
	for (int i = 0; i < MAX_REGIONS; i++) {
		region *r = &fs->regions[i];
		if (__atomic_load_n(&r->used, __ATOMIC_ACQUIRE) && page >= r->base &&
		    page < r->base + r->npages * (uint64_t)fs->ps) {
			*idx = (page - r->base) / (uint64_t)fs->ps;
			return r;
		}
	}
	return NULL;
}

// restore tries to install page i of r from where the evictor put it. It returns 0
// when it installed nothing (the caller zero-fills), 1 when the page is now present,
// or EAGAIN. It never waits for Go.
static int restore(odp_fs *fs, region *r, uint64_t i, uint64_t page) {
	uint32_t *st = &r->state[i];
	uint32_t s = __atomic_load_n(st, __ATOMIC_ACQUIRE);
	if (s == ODP_PAGE_DISCARDED || s == ODP_PAGE_REMAPPED || s == ODP_PAGE_GONE)
		return 0; // nothing to give back here: a fault zero-fills (or finds it gone)
	if (s == ODP_PAGE_EVICTING)
		__atomic_compare_exchange_n(st, &s, ODP_PAGE_RECLAIMED, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
	s = __atomic_load_n(st, __ATOMIC_ACQUIRE);
	if (s == ODP_PAGE_RECLAIMED) {
		// The content is in the bounce page, or still in place (then this fault
		// came first and the page is missing anyway).
		struct uffdio_move m = {.dst = page, .src = r->bounce + i * (uint64_t)fs->ps, .len = (uint64_t)fs->ps};
		if (ioctl(fs->uffd, UFFDIO_MOVE, &m) == 0) {
			// Settled; an evictor still running on the page finds its CAS failing and
			// its own move back finding the page present.
			uint32_t want = ODP_PAGE_RECLAIMED;
			__atomic_compare_exchange_n(st, &want, ODP_PAGE_NONE, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
			add(&fs->restored, 1);
			return 1;
		}
		if (errno == EAGAIN)
			return EAGAIN;
		return errno == EEXIST ? 1 : 0;
	}
	if (s == ODP_PAGE_STORED && fs->store_fd >= 0) {
		ssize_t n = pread(fs->store_fd, fs->bounce_buf, (size_t)fs->ps, (off_t)(r->store_off + i * (uint64_t)fs->ps));
		if (n != fs->ps) {
			// The store lost it (it never should: its room was allocated before the
			// page moved out). Counted, and the page reads as zero from now on.
			add(&fs->st.errors, 1);
			uint32_t want = ODP_PAGE_STORED;
			__atomic_compare_exchange_n(st, &want, ODP_PAGE_NONE, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
			return 0;
		}
		struct uffdio_copy c = {.dst = page, .src = (uint64_t)fs->bounce_buf, .len = (uint64_t)fs->ps,
		                        .mode = UFFDIO_COPY_MODE_DONTWAKE};
		int copied = ioctl(fs->uffd, UFFDIO_COPY, &c) == 0;
		if (copied || errno == EEXIST) {
			if (copied)
				resident_add(fs, 1); // (one taken back from its bounce page was never subtracted)
			uint32_t want = ODP_PAGE_STORED;
			if (__atomic_compare_exchange_n(st, &want, ODP_PAGE_NONE, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
				queue_punch(fs, (uint64_t)(off_t)(r->store_off + i * (uint64_t)fs->ps));
			add(&fs->restored, 1);
			return 1;
		}
		return errno == EAGAIN ? EAGAIN : 0;
	}
	return 0;
}

// zap_passed ends REMOVING for page idx of r (if r): the page was found missing and
// filled, so the zap of the REMOVE that marked it has passed it.
static void zap_passed(region *r, uint64_t idx) {
	uint32_t want = ODP_PAGE_REMOVING;
	if (r)
		__atomic_compare_exchange_n(&r->state[idx], &want, ODP_PAGE_NONE, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

// claim_fill takes page idx of r for a zero fill (NONE -> INSTALLING) and returns its
// state word, which the caller sets back to NONE after the copy; or NULL, with the
// state it found in *seen. Without the claim an evictor could move a present page out
// between restore's look and the copy, and store its content under the zero page
// mapped over it.
static uint32_t *claim_fill(region *r, uint64_t idx, uint32_t *seen) {
	*seen = ODP_PAGE_NONE;
	if (__atomic_compare_exchange_n(&r->state[idx], seen, ODP_PAGE_INSTALLING, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
		return &r->state[idx];
	return NULL;
}

// fill_busy reports whether a page whose claim_fill found it in state s is an
// evictor's (its content may be on its way out: ask restore again) rather than one
// that reads as zero whatever happens (DISCARDED, REMOVING, GONE, REMAPPED: no
// eviction starts on it).
static int fill_busy(uint32_t s) {
	return s != ODP_PAGE_DISCARDED && s != ODP_PAGE_REMOVING && s != ODP_PAGE_GONE && s != ODP_PAGE_REMAPPED;
}

static void release_fill(uint32_t *claim) {
	if (claim)
		__atomic_store_n(claim, ODP_PAGE_NONE, __ATOMIC_RELEASE);
}

static long futex(int32_t *addr, int op, int32_t val, const struct timespec *ts);
static void gate_open(odp_fs *fs);

typedef struct victim { region *r; uint64_t i; } victim;

static int moved_anyway(odp_fs *fs, uint64_t src, uint64_t dst);
static int64_t count_present(odp_fs *fs, uint64_t lo, uint64_t hi);

// pick_victims fills v with up to max pages to evict: present (pagemap), evictable,
// in state NONE, not referenced, and not skip. It walks the regions from the hand on,
// CLOCK order: a referenced page loses its bit and gets a second chance, so it looks
// at each page at most twice per call. It returns how many it found. Called with rmu
// held.
static int pick_victims(odp_fs *fs, victim *v, int max, uint64_t skip) {
	uint64_t total = 0;
	for (int k = 0; k < MAX_REGIONS; k++)
		if (__atomic_load_n(&fs->regions[k].used, __ATOMIC_ACQUIRE))
			total += fs->regions[k].npages;
	uint64_t pm[EVICT_BATCH];
	uint64_t ps = (uint64_t)fs->ps;
	int n = 0;
	for (uint64_t scanned = 0; n < max && scanned < 2 * total;) {
		region *r = &fs->regions[fs->hand_slot % MAX_REGIONS];
		if (!__atomic_load_n(&r->used, __ATOMIC_ACQUIRE) || fs->hand_page >= r->npages) {
			fs->hand_slot = (fs->hand_slot + 1) % MAX_REGIONS;
			fs->hand_page = 0;
			continue;
		}
		uint64_t first = fs->hand_page, cnt = r->npages - first;
		if (cnt > EVICT_BATCH)
			cnt = EVICT_BATCH;
		fs->hand_page = first + cnt;
		scanned += cnt;
		off_t at = (off_t)((r->base / ps + first) * sizeof pm[0]);
		if (pread(fs->pagemap, pm, cnt * sizeof pm[0], at) != (ssize_t)(cnt * sizeof pm[0]))
			continue;
		for (uint64_t j = 0; j < cnt && n < max; j++) {
			uint64_t i = first + j;
			if (!(pm[j] >> 63) || r->base + i * ps == skip || !__atomic_load_n(&r->evictable[i], __ATOMIC_ACQUIRE) ||
			    __atomic_load_n(&r->state[i], __ATOMIC_ACQUIRE) != ODP_PAGE_NONE)
				continue;
			uint32_t ref = __atomic_load_n(&r->ref[i], __ATOMIC_ACQUIRE);
			if (ref == ODP_REF_HELD)
				continue; // installed for the NIC, which has not touched it yet
			if (ref == ODP_REF_SET && __atomic_compare_exchange_n(&r->ref[i], &ref, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
				continue; // second chance
			v[n++] = (victim){r, i};
			if (n == max)
				fs->hand_page = i + 1; // the next search starts after the last victim
		}
	}
	return n;
}

// evict_drain closes the gate and waits, at most EVICT_DRAIN_NS, until no DMA is in
// flight. It returns 0 then, or -1 (the gate still closed: the caller opens it): a DMA
// in flight may itself wait for the fault being served (see gate_drain).
static int evict_drain(odp_fs *fs) {
	odp_gate *g = fs->gate;
	__atomic_store_n(&g->closed, 1, __ATOMIC_SEQ_CST);
	uint64_t t0 = now_ns();
	for (;;) {
		int32_t v = __atomic_load_n(&g->inflight, __ATOMIC_SEQ_CST);
		if (v == 0)
			return 0;
		if (now_ns() - t0 >= EVICT_DRAIN_NS)
			return -1;
		struct timespec ts = {0, EVICT_POLL_NS};
		futex(&g->inflight, FUTEX_WAIT_PRIVATE, v, &ts);
	}
}

// drop_scratch frees the scratch pages. A page of a range registered on the
// userfaultfd cannot be dropped by the thread that reads it (MADV_DONTNEED would wait
// for its own REMOVE event), so the scratch area leaves the userfaultfd for the
// madvise and joins it again; if it cannot, direct reclaim stops.
static void drop_scratch(odp_fs *fs) {
	size_t len = (size_t)fs->ps * EVICT_BATCH;
	struct uffdio_range rg = {.start = (uint64_t)fs->scratch, .len = len};
	struct uffdio_register reg = {.range = rg, .mode = UFFDIO_REGISTER_MODE_MISSING};
	if (ioctl(fs->uffd, UFFDIO_UNREGISTER, &rg) != 0 || madvise(fs->scratch, len, MADV_DONTNEED) != 0 ||
	    ioctl(fs->uffd, UFFDIO_REGISTER, &reg) != 0)
		fs->scratch = NULL; // leaked: nothing else may map it (odp_fs_stop unmaps it)
}

// evict moves up to want (at most EVICT_BATCH) victims to the store with no DMA in
// flight, and queues an ODP_EVENT_EVICT for each run of evicted pages before it opens
// the gate, so that no DMA trusts a translation of them before the NIC dropped it.
// Each page leaves the application's mapping atomically (UFFDIO_MOVE into the scratch
// area): a write either lands before the move and is stored, or faults after it and
// is served from the store. It returns how many pages it evicted, or -EAGAIN when the
// kernel refused a move because an event waits to be read, -EBUSY when DMA in flight
// did not drain, or -ENOENT when it found no victim. Called with rmu held.
static int evict(odp_fs *fs, int want, uint64_t skip) {
	if (!fs->scratch || fs->pagemap < 0 || fs->store_fd < 0)
		return -ENOENT;
	if (want > EVICT_BATCH)
		want = EVICT_BATCH;
	victim v[EVICT_BATCH];
	int n = pick_victims(fs, v, want, skip);
	if (n == 0)
		return -ENOENT;
	if (evict_drain(fs) != 0) {
		gate_open(fs);
		return -EBUSY;
	}
	uint64_t ps = (uint64_t)fs->ps;
	int done = 0, again = 0;
	victim got[EVICT_BATCH];
	for (int k = 0; k < n && !again; k++) {
		region *r = v[k].r;
		uint64_t i = v[k].i, page = r->base + i * ps;
		off_t off = (off_t)(r->store_off + i * ps);
		uint32_t s = ODP_PAGE_NONE;
		if (!__atomic_compare_exchange_n(&r->state[i], &s, ODP_PAGE_DIRECT, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
			continue; // claimed meanwhile (Go's evictor)
		char *slot = fs->scratch + (size_t)done * ps;
		pthread_mutex_lock(&fs->store_mu);
		// Room in the store first: once the page has moved out, the write must not fail.
		struct uffdio_move m = {.dst = (uint64_t)slot, .src = page, .len = ps};
		int ok = fallocate(fs->store_fd, 0, off, (off_t)ps) == 0;
		if (ok && ioctl(fs->uffd, UFFDIO_MOVE, &m) != 0 && !moved_anyway(fs, page, (uint64_t)slot)) {
			again = errno == EAGAIN;
			ok = 0;
		}
		if (ok && pwrite(fs->store_fd, slot, ps, off) != (ssize_t)ps) {
			// Put it back (the kernel refuses only while an event waits, and none can
			// be read meanwhile: then the content is lost, and said so).
			struct uffdio_move b = {.dst = page, .src = (uint64_t)slot, .len = ps};
			if (ioctl(fs->uffd, UFFDIO_MOVE, &b) != 0)
				add(&fs->st.errors, 1);
			ok = 0;
		}
		// Nobody else changes a DIRECT page: only this thread reads events and serves
		// faults, and the Go evictor claims only NONE pages.
		__atomic_store_n(&r->state[i], ok ? ODP_PAGE_STORED : ODP_PAGE_NONE, __ATOMIC_RELEASE);
		pthread_mutex_unlock(&fs->store_mu);
		if (ok)
			got[done++] = v[k];
	}
	uint64_t t = now_ns();
	for (int k = 0; k < done;) {
		int j = k + 1;
		while (j < done && got[j].r == got[k].r && got[j].i == got[j - 1].i + 1)
			j++;
		struct uffd_msg m = {.event = ODP_EVENT_EVICT};
		m.arg.remove.start = got[k].r->base + got[k].i * ps;
		m.arg.remove.end = got[j - 1].r->base + (got[j - 1].i + 1) * ps;
		queue_event(fs, &m, t);
		k = j;
	}
	gate_open(fs);
	if (done > 0) {
		resident_add(fs, -done);
		add(&fs->st.evicted, (uint64_t)done);
		drop_scratch(fs);
	}
	return again && done == 0 ? -EAGAIN : done;
}

// over_budget reports whether installing n more pages would take the resident
// estimate past the budget.
static int over_budget(odp_fs *fs, uint64_t n) {
	int64_t budget = __atomic_load_n(&fs->budget, __ATOMIC_ACQUIRE);
	return budget > 0 && __atomic_load_n(&fs->resident, __ATOMIC_ACQUIRE) + (int64_t)n > budget;
}

// page_present reports whether page is present, from pagemap (0 if it cannot tell).
static int page_present(odp_fs *fs, uint64_t page) { return count_present(fs, page, page + (uint64_t)fs->ps) > 0; }

// moved_anyway reports whether a UFFDIO_MOVE of one page from src to dst that failed
// moved the page all the same: src missing and dst present. The kernel has been seen
// to do so (6.18: EEXIST after a wait of milliseconds, the page in the destination:
// a move retried internally that found its own result in the way). Believing the
// error would lose the page: the caller would take it for still in place. Only the
// caller moves pages between the two addresses meanwhile.
static int moved_anyway(odp_fs *fs, uint64_t src, uint64_t dst) {
	int e = errno;
	int moved = !page_present(fs, src) && page_present(fs, dst);
	errno = e;
	return moved;
}

// make_room evicts before n pages are installed, so that the resident estimate stays
// within the budget: a batch at a time, an eighth of the budget (1 to EVICT_BATCH
// pages), which leaves room for the next faults (a low watermark). It returns EAGAIN
// when the kernel refused moves while an event waits to be read (the caller retries
// once it is read); otherwise 0, having counted as overshoot the pages it found no
// room for. Called with rmu held.
static int make_room(odp_fs *fs, uint64_t n, uint64_t skip) {
	if (!over_budget(fs, n))
		return 0;
	int64_t budget = __atomic_load_n(&fs->budget, __ATOMIC_ACQUIRE);
	if (fs->reclaim_idle > 0) {
		// The last reclaim found nothing to evict, or DMA did not drain: a batch of
		// installs goes past the budget before the next try.
		fs->reclaim_idle -= n < fs->reclaim_idle ? n : fs->reclaim_idle;
		add(&fs->st.overshoot, n);
		return 0;
	}
	add(&fs->st.reclaims, 1);
	int batch = budget / 8 < 1 ? 1 : budget / 8 > EVICT_BATCH ? EVICT_BATCH : (int)(budget / 8);
	for (int tries = 0; __atomic_load_n(&fs->resident, __ATOMIC_ACQUIRE) + (int64_t)n > budget; tries++) {
		int got = evict(fs, batch, skip);
		if (got == -EAGAIN)
			return EAGAIN;
		if (got == 0 && tries < 4)
			continue; // victims claimed by Go's evictor meanwhile: look further
		if (got <= 0) {
			// Nothing to evict, or DMA that did not drain: neither changes at once,
			// so the next installs pass before reclaim looks again. Victims that
			// Go's evictor kept claiming are on their way out: the next install
			// tries again.
			if (got < 0)
				fs->reclaim_idle = EVICT_BATCH;
			add(&fs->st.overshoot, n);
			return 0;
		}
	}
	return 0;
}

// resolve returns 0 when the fault is served, EAGAIN when it must be retried. Counters
// are updated before the faulting thread is woken, so they are exact once it runs.
static int resolve(odp_fs *fs, uint64_t addr, uint64_t flags, uint64_t t0) {
	uint64_t page = addr & ~((uint64_t)fs->ps - 1);
	uint64_t idx = 0;
	region *r = find(fs, page, &idx);
	uint32_t *claim = NULL;
	if (r) {
		int got = make_room(fs, fs->around, page);
		// Restore what was evicted, or claim the page for the zero fill; an evictor
		// that claimed it in between has begun moving content out: restore again.
		// If it still holds the page, the thread is woken without a fill: it faults
		// again if the page is missing, and meanwhile the evictor settles it.
		for (int tries = 0; got != EAGAIN; tries++) {
			uint32_t seen;
			got = restore(fs, r, idx, page);
			if (got != 0 || (claim = claim_fill(r, idx, &seen)) != NULL || !fill_busy(seen))
				break;
			if (tries == 3) {
				add(&fs->st.retries, 1);
				record(fs, page, page + (uint64_t)fs->ps);
				account(fs, t0);
				wake(fs, page);
				return 0;
			}
		}
		if (got == EAGAIN) {
			add(&fs->st.retries, 1);
			return EAGAIN;
		}
		if (got == 1) {
			__atomic_store_n(&r->ref[idx], ODP_REF_SET, __ATOMIC_RELEASE);
			record(fs, page, page + (uint64_t)fs->ps);
			add(&fs->st.pages, 1);
			add(&fs->st.faults, 1);
			if (flags & UFFD_PAGEFAULT_FLAG_WRITE)
				add(&fs->st.write_faults, 1);
			account(fs, t0);
			wake(fs, page);
			return 0;
		}
	}
	struct uffdio_copy c = {.dst = page, .src = (uint64_t)fs->zero, .len = (uint64_t)fs->ps,
	                        .mode = UFFDIO_COPY_MODE_DONTWAKE};
	if (ioctl(fs->uffd, UFFDIO_COPY, &c) != 0) {
		int e = errno;
		release_fill(claim);
		if (e == EAGAIN) {
			add(&fs->st.retries, 1);
			return EAGAIN;
		}
		// EEXIST: installed meanwhile (by the NIC's resolver); anything else: the
		// range is gone. Either way wake the faulting thread; it retries the access.
		// The page was missing when the thread touched it: recorded like an install.
		add(e == EEXIST ? &fs->st.exist : &fs->st.errors, 1);
		record(fs, page, page + (uint64_t)fs->ps);
		account(fs, t0);
		wake(fs, page);
		return 0;
	}
	uint64_t end = page + (uint64_t)fs->ps;
	add(&fs->st.pages, 1);
	if (r) {
		resident_add(fs, 1);
		__atomic_store_n(&r->ref[idx], ODP_REF_SET, __ATOMIC_RELEASE); // the access bit of a fresh page
	}
	release_fill(claim);
	zap_passed(r, idx);
	// Forward fault-around over the pages that follow in state NONE, each claimed like
	// the faulting page: never a zero fill over content that is being evicted. Best
	// effort: the copy stops at the first present page and fails as a whole past the
	// end of the registered range.
	uint64_t around = fs->around;
	for (uint64_t k = 1; r && k < around; k++) {
		uint32_t seen;
		if (idx + k >= r->npages || !claim_fill(r, idx + k, &seen))
			around = k;
	}
	if (around > 1) {
		struct uffdio_copy a = {.dst = page + (uint64_t)fs->ps, .src = (uint64_t)fs->zero,
		                        .len = (uint64_t)fs->ps * (around - 1), .mode = UFFDIO_COPY_MODE_DONTWAKE};
		ioctl(fs->uffd, UFFDIO_COPY, &a);
		for (uint64_t k = 1; r && k < around; k++)
			release_fill(&r->state[idx + k]);
		if (a.copy > 0) {
			add(&fs->st.pages, (uint64_t)a.copy / (uint64_t)fs->ps);
			if (r)
				resident_add(fs, a.copy / fs->ps);
			end += (uint64_t)a.copy;
		}
	}
	record(fs, page, end);
	if (flags & UFFD_PAGEFAULT_FLAG_WRITE)
		add(&fs->st.write_faults, 1);
	add(&fs->st.faults, 1);
	account(fs, t0);
	wake(fs, page);
	return 0;
}

// count_present returns how many pages of [lo, hi) are present (pagemap), 0 if it
// cannot tell.
static int64_t count_present(odp_fs *fs, uint64_t lo, uint64_t hi) {
	uint64_t pm[EVICT_BATCH];
	uint64_t ps = (uint64_t)fs->ps;
	int64_t n = 0;
	for (uint64_t a = lo; fs->pagemap >= 0 && a < hi;) {
		uint64_t cnt = (hi - a) / ps;
		if (cnt > EVICT_BATCH)
			cnt = EVICT_BATCH;
		if (cnt == 0 ||
		    pread(fs->pagemap, pm, cnt * sizeof pm[0], (off_t)(a / ps * sizeof pm[0])) != (ssize_t)(cnt * sizeof pm[0]))
			return n;
		for (uint64_t j = 0; j < cnt; j++)
			n += (int64_t)(pm[j] >> 63);
		a += cnt * ps;
	}
	return n;
}

// forget drops the stored copies of [start, end) in every region: after MADV_DONTNEED
// a page reads as zeros, not as what was evicted; after munmap (gone) the address is
// never touched again, whatever is mapped there later. Runs when the event is read.
static void forget(odp_fs *fs, uint64_t start, uint64_t end, int gone) {
	for (int k = 0; k < MAX_REGIONS; k++) {
		region *r = &fs->regions[k];
		if (!__atomic_load_n(&r->used, __ATOMIC_ACQUIRE))
			continue;
		uint64_t rend = r->base + r->npages * (uint64_t)fs->ps;
		uint64_t lo = start > r->base ? start : r->base, hi = end < rend ? end : rend;
		if (!gone && lo < hi)
			resident_add(fs, -count_present(fs, lo, hi)); // zapped once this read returns
		for (uint64_t a = lo; a < hi; a += (uint64_t)fs->ps) {
			uint64_t i = (a - r->base) / (uint64_t)fs->ps;
			uint32_t *st = &r->state[i];
			uint32_t prev;
			if (gone) {
				// A REMAPPED page is retired by restore_at once its content moved on.
				do
					prev = __atomic_load_n(st, __ATOMIC_ACQUIRE);
				while (prev != ODP_PAGE_REMAPPED &&
				       !__atomic_compare_exchange_n(st, &prev, ODP_PAGE_GONE, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
			} else {
				// Discarded: a stored copy is dropped; a page on its way to the store
				// (or back from it) must never come back with its old content; a page
				// in place is zapped only after this read, so until a fault or an
				// install finds it missing it must not be evicted (REMOVING).
				for (;;) {
					prev = __atomic_load_n(st, __ATOMIC_ACQUIRE);
					uint32_t next = prev == ODP_PAGE_STORED ? ODP_PAGE_NONE
					              : (prev == ODP_PAGE_EVICTING || prev == ODP_PAGE_RECLAIMED) ? ODP_PAGE_DISCARDED
					              : prev == ODP_PAGE_NONE ? ODP_PAGE_REMOVING
					              : prev;
					if (next == prev || __atomic_compare_exchange_n(st, &prev, next, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
						break;
				}
			}
			if (prev == ODP_PAGE_STORED && fs->store_fd >= 0)
				queue_punch(fs, (uint64_t)(off_t)(r->store_off + i * (uint64_t)fs->ps));
		}
	}
}

// A stored page's content, taken out of the store, to be put back at a new address
// after mremap.
// after mremap: either a stored page's content taken out of the store (page), or the
// bounce page of a page that was being evicted (bounce), for the address it was at
// (from), to be installed at its new address (to).
typedef struct restoring { char *page; uint64_t to, bounce, from; } restoring;

// restore_at installs a taken-out page at to and frees it, or moves an evicting page's
// bounce content there (a hole when the evictor had not moved it yet: the page then
// moved with the mapping) and retires the old address. It returns EAGAIN while the
// kernel still counts the mremap as in progress (every copy fails then, faults too).
static int restore_at(odp_fs *fs, restoring *x) {
	if (x->bounce) {
		struct uffdio_move m = {.dst = x->to, .src = x->bounce, .len = (uint64_t)fs->ps, .mode = UFFDIO_MOVE_MODE_ALLOW_SRC_HOLES};
		if (ioctl(fs->uffd, UFFDIO_MOVE, &m) != 0 && errno == EAGAIN)
			return EAGAIN;
		if (m.move > 0)
			add(&fs->restored, 1);
		uint64_t idx = 0;
		region *r = find(fs, x->from, &idx);
		uint32_t want = ODP_PAGE_REMAPPED;
		if (r) // the evictor leaves a REMAPPED page alone; now it is gone for good
			__atomic_compare_exchange_n(&r->state[idx], &want, ODP_PAGE_GONE, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
		return 0;
	}
	struct uffdio_copy c = {.dst = x->to, .src = (uint64_t)x->page, .len = (uint64_t)fs->ps};
	if (ioctl(fs->uffd, UFFDIO_COPY, &c) != 0 && errno == EAGAIN)
		return EAGAIN;
	free(x->page);
	add(&fs->restored, 1);
	return 0;
}

// queue_restore appends x to the loop's restore queue; it reports false when out of
// memory (the page then reads as zero at its new address).
static int queue_restore(restoring x, restoring **q, int *n, int *cap) {
	if (*n == *cap) {
		int nc = *cap ? *cap * 2 : 64;
		restoring *nq = realloc(*q, sizeof(**q) * (size_t)nc);
		if (!nq)
			return 0;
		*q = nq;
		*cap = nc;
	}
	(*q)[(*n)++] = x;
	return 1;
}

// moved queues the stored pages of [from, from+len) to be restored at their new
// address after mremap (the store is keyed by address; a swap entry would have moved
// with its page table entry). The loop restores them before serving faults.
static void moved(odp_fs *fs, uint64_t from, uint64_t to, uint64_t len, restoring **q, int *n, int *cap) {
	for (int k = 0; k < MAX_REGIONS; k++) {
		region *r = &fs->regions[k];
		if (!__atomic_load_n(&r->used, __ATOMIC_ACQUIRE) || fs->store_fd < 0)
			continue;
		uint64_t rend = r->base + r->npages * (uint64_t)fs->ps;
		uint64_t lo = from > r->base ? from : r->base, hi = from + len < rend ? from + len : rend;
		for (uint64_t a = lo; a < hi; a += (uint64_t)fs->ps) {
			uint64_t i = (a - r->base) / (uint64_t)fs->ps;
			uint32_t s = __atomic_load_n(&r->state[i], __ATOMIC_ACQUIRE);
			if ((s == ODP_PAGE_EVICTING || s == ODP_PAGE_RECLAIMED) &&
			    __atomic_compare_exchange_n(&r->state[i], &s, ODP_PAGE_REMAPPED, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
				// On its way to the store, or back: its content is in the bounce page
				// (or moved with the mapping). The evictor leaves it alone now.
				queue_restore((restoring){NULL, to + (a - from), r->bounce + i * (uint64_t)fs->ps, a}, q, n, cap);
				continue;
			}
			if (s != ODP_PAGE_STORED)
				continue;
			// Take the content out now: the UNMAP of the old range that follows in the
			// same batch forgets the stored copy.
			off_t off = (off_t)(r->store_off + i * (uint64_t)fs->ps);
			char *page = aligned_alloc((size_t)fs->ps, (size_t)fs->ps);
			if (!page || pread(fs->store_fd, page, (size_t)fs->ps, off) != fs->ps) {
				free(page);
				continue;
			}
			uint32_t want = ODP_PAGE_STORED;
			if (__atomic_compare_exchange_n(&r->state[i], &want, ODP_PAGE_NONE, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
				queue_punch(fs, (uint64_t)off);
			if (!queue_restore((restoring){page, to + (a - from), 0, a}, q, n, cap)) {
				free(page);
				return; // out of memory: the page reads as zero at its new address
			}
		}
	}
}

// install_one makes page present the way a fault would, without a faulting thread:
// from the bounce page or the store if it was evicted, zero-filled otherwise. It
// returns EAGAIN when it must be retried.
static int install_one(odp_fs *fs, uint64_t page) {
	uint64_t idx = 0;
	region *r = find(fs, page, &idx);
	uint32_t *claim = NULL;
	if (r) {
		// A request covers present pages too: those need no room (asked only when
		// over the budget, where it saves an eviction).
		int got = over_budget(fs, 1) && !page_present(fs, page) ? make_room(fs, 1, page) : 0;
		if (got != EAGAIN)
			got = restore(fs, r, idx, page);
		if (got == EAGAIN)
			return EAGAIN;
		if (got == 1) {
			__atomic_store_n(&r->ref[idx], ODP_REF_HELD, __ATOMIC_RELEASE);
			add(&fs->st.pages, 1);
			return 0;
		}
		// The page may be present (a request covers present pages too): claimed, the
		// evictor cannot move it out between this decision and the copy.
		uint32_t seen;
		if ((claim = claim_fill(r, idx, &seen)) == NULL) {
			if (fill_busy(seen))
				return EAGAIN; // evicting meanwhile: again
			if (seen == ODP_PAGE_GONE || seen == ODP_PAGE_REMAPPED)
				return ENOENT; // not mapped here any more
		}
	}
	struct uffdio_copy c = {.dst = page, .src = (uint64_t)fs->zero, .len = (uint64_t)fs->ps};
	int e = 0;
	if (ioctl(fs->uffd, UFFDIO_COPY, &c) == 0) {
		add(&fs->st.pages, 1);
		if (r) {
			resident_add(fs, 1);
			__atomic_store_n(&r->ref[idx], ODP_REF_HELD, __ATOMIC_RELEASE);
		}
		zap_passed(r, idx);
	} else if (errno == EAGAIN) {
		e = EAGAIN;
	} else if (errno != EEXIST) {
		e = ENOENT; // not registered or unmapped
	}
	release_fill(claim);
	return e;
}

// serve_installs works through queued install requests; it returns with the first
// one that must wait (EAGAIN) at the head.
static void serve_installs(odp_fs *fs) {
	for (;;) {
		pthread_mutex_lock(&fs->imu);
		install_req *q = fs->ihead;
		pthread_mutex_unlock(&fs->imu);
		if (!q)
			return;
		for (; q->next < q->end; q->next += (uint64_t)fs->ps) {
			int e = install_one(fs, q->next);
			if (e == EAGAIN)
				return;
			if (e)
				q->failed = 1;
		}
		pthread_mutex_lock(&fs->imu);
		fs->ihead = q->link;
		if (!fs->ihead)
			fs->itail = NULL;
		pthread_mutex_unlock(&fs->imu);
		uint64_t v = q->failed ? ODP_INSTALL_UNMAPPED : ODP_INSTALL_DONE;
		ssize_t w = write(q->done_fd, &v, sizeof v);
		(void)w;
		free(q);
	}
}

int odp_fs_install(odp_fs *fs, uint64_t start, uint64_t npages, int done_fd) {
	install_req *q = calloc(1, sizeof *q);
	if (!q)
		return ENOMEM;
	q->next = start;
	q->end = start + npages * (uint64_t)fs->ps;
	q->done_fd = done_fd;
	pthread_mutex_lock(&fs->imu);
	if (fs->itail)
		fs->itail->link = q;
	else
		fs->ihead = q;
	fs->itail = q;
	pthread_mutex_unlock(&fs->imu);
	uint64_t one = 1;
	ssize_t w = write(fs->ifd, &one, sizeof one);
	(void)w;
	return 0;
}

typedef struct pending { uint64_t addr, flags, t0; } pending;

odp_gate *odp_gate_alloc(void) { return calloc(1, sizeof(odp_gate)); }

void odp_gate_free(odp_gate *g) { free(g); }

static long futex(int32_t *addr, int op, int32_t val, const struct timespec *ts) {
	return syscall(SYS_futex, addr, op, val, ts, NULL, 0);
}

// pending_faults returns how many faults wait to be read (the userfaultfd's fdinfo
// "pending" count), or 1 when that cannot be read.
static long pending_faults(odp_fs *fs) {
	char buf[512];
	if (fs->fdinfo < 0)
		return 1;
	ssize_t n = pread(fs->fdinfo, buf, sizeof buf - 1, 0);
	if (n <= 0)
		return 1;
	buf[n] = 0;
	char *p = strstr(buf, "pending:");
	return p ? strtol(p + 8, NULL, 10) : 1;
}

// gate_drain closes the gate and waits until no DMA is in flight; it returns 0 then.
//
// A DMA in flight may itself wait for this thread: its copy can fault on a page that
// an application's madvise zapped under it (doc.go), and at GOMAXPROCS=1 the goroutine
// holding the DMA may not run before an application goroutine's fault is served. So
// while it waits it looks for faults waiting to be read, and returns their count (the
// gate still closed) for the caller to read just those: read(2) returns faults before
// events. But while an event waits to be read, the kernel refuses every install
// (EAGAIN), so a fault read meanwhile cannot be served before the event is: once such
// faults wait (npend) and the DMA still does not drain, it returns -1 and the caller
// reads the event with DMA in flight, the one case in which a change may overlap a DMA
// (counted as undrained; package odp makes a copy that a zap tore again).
static long gate_drain(odp_fs *fs, int npend) {
	odp_gate *g = fs->gate;
	__atomic_store_n(&g->closed, 1, __ATOMIC_SEQ_CST);
	int32_t v = __atomic_load_n(&g->inflight, __ATOMIC_SEQ_CST);
	if (v == 0)
		return 0;
	uint64_t t0 = now_ns();
	while (v != 0) {
		struct timespec ts = {0, DRAIN_POLL_NS};
		if (futex(&g->inflight, FUTEX_WAIT_PRIVATE, v, &ts) != 0 && errno == ETIMEDOUT) {
			long p = pending_faults(fs);
			if (p > 0) {
				add(&fs->st.fault_reads, 1);
				return p;
			}
			if (npend > 0)
				return -1;
		}
		v = __atomic_load_n(&g->inflight, __ATOMIC_SEQ_CST);
	}
	add(&fs->st.drains, 1);
	note_time(&fs->st.drain_ns, &fs->st.max_drain_ns, now_ns() - t0);
	return 0;
}

// gate_open lets DMA start again and wakes the DMAs that wait for it.
static void gate_open(odp_fs *fs) {
	if (__atomic_exchange_n(&fs->gate->closed, 0, __ATOMIC_SEQ_CST) == 2)
		futex(&fs->gate->closed, FUTEX_WAKE_PRIVATE, INT_MAX, NULL);
}

static void *loop(void *arg) {
	odp_fs *fs = arg;
	sigset_t all;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, NULL);

	struct uffd_msg msgs[MSG_BATCH];
	pending pend[MAX_PENDING]; // 96 KiB of the thread's stack
	int npend = 0;
	restoring *rq = NULL;
	int nrq = 0, caprq = 0;
	for (;;) {
		struct pollfd p[3] = {{.fd = fs->uffd, .events = POLLIN}, {.fd = fs->stopfd, .events = POLLIN},
		                      {.fd = fs->ifd, .events = POLLIN}};
		pthread_mutex_lock(&fs->imu);
		int ninst = fs->ihead != NULL;
		pthread_mutex_unlock(&fs->imu);
		int pr = poll(p, 3, npend || nrq || ninst ? 0 : -1);
		if (p[2].revents) {
			uint64_t v;
			ssize_t rr = read(fs->ifd, &v, sizeof v);
			(void)rr;
		}
		if (pr < 0 && errno != EINTR)
			break;
		if (p[1].revents)
			break;
		if (p[0].revents & (POLLERR | POLLHUP | POLLNVAL))
			break;
		// Regions are added and removed under rmu; holding it while working on a batch
		// means a region's state words are never touched after its removal returns.
		int readable = (p[0].revents & POLLIN) && npend < MAX_PENDING - MSG_BATCH;
		// No DMA may overlap the change that reading an event releases: drain first.
		long only = readable ? gate_drain(fs, npend) : 0;
		pthread_mutex_lock(&fs->rmu);
		if (readable) {
			// The kernel lets the thread that raised an event go on as soon as read(2)
			// returns it; "reading" covers that gap until the event is counted.
			__atomic_store_n(&fs->reading, 1, __ATOMIC_SEQ_CST);
			size_t want = only > 0 && only < MSG_BATCH ? (size_t)only : MSG_BATCH;
			ssize_t n = read(fs->uffd, msgs, want * sizeof msgs[0]);
			uint64_t t0 = now_ns();
			for (ssize_t i = 0; n > 0 && i < n / (ssize_t)sizeof(msgs[0]); i++) {
				if (msgs[i].event == UFFD_EVENT_PAGEFAULT) {
					pend[npend++] = (pending){msgs[i].arg.pagefault.address, msgs[i].arg.pagefault.flags, t0};
				} else {
					struct uffd_msg *m = &msgs[i];
					if (only != 0)
						add(&fs->st.undrained, 1);
					if (m->event == UFFD_EVENT_REMOVE || m->event == UFFD_EVENT_UNMAP)
						forget(fs, m->arg.remove.start, m->arg.remove.end, m->event == UFFD_EVENT_UNMAP);
					else if (m->event == UFFD_EVENT_REMAP)
						moved(fs, m->arg.remap.from, m->arg.remap.to, m->arg.remap.len, &rq, &nrq, &caprq);
					else if (m->event == UFFD_EVENT_FORK)
						close((int)m->arg.fork.ufd); // nobody serves the child: its ranges unregister
					queue_event(fs, m, t0);
				}
			}
			__atomic_store_n(&fs->reading, 0, __ATOMIC_SEQ_CST);
			gate_open(fs);
		}
		int keepr = 0;
		for (int i = 0; i < nrq; i++)
			if (restore_at(fs, &rq[i]) == EAGAIN)
				rq[keepr++] = rq[i];
		nrq = keepr;
		int keep = 0;
		for (int i = 0; i < npend && nrq == 0; i++) {
			if (resolve(fs, pend[i].addr, pend[i].flags, pend[i].t0) == EAGAIN)
				pend[keep++] = pend[i];
		}
		if (nrq == 0) {
			npend = keep;
			serve_installs(fs);
		}
		pthread_mutex_unlock(&fs->rmu);
		if (npend || nrq)
			sched_yield(); // an event is pending; it is read on the next turn
	}
	for (int i = 0; i < nrq; i++)
		free(rq[i].page);
	free(rq);
	return NULL;
}

// release_reclaim closes and unmaps what direct reclaim used. The scratch area leaves
// the userfaultfd first: munmap of a registered range would wait for its UNMAP event
// to be read, and the server thread is gone.
static void release_reclaim(odp_fs *fs) {
	if (fs->scratch_map) {
		struct uffdio_range rg = {.start = (uint64_t)fs->scratch_map, .len = (uint64_t)fs->ps * EVICT_BATCH};
		ioctl(fs->uffd, UFFDIO_UNREGISTER, &rg);
		munmap(fs->scratch_map, (size_t)fs->ps * EVICT_BATCH);
	}
	if (fs->pagemap >= 0)
		close(fs->pagemap);
	pthread_mutex_destroy(&fs->store_mu);
}

odp_fs *odp_fs_start(int uffd, unsigned around, odp_gate *gate, int *err) {
	odp_fs *fs = calloc(1, sizeof *fs);
	if (fs == NULL) {
		*err = ENOMEM;
		return NULL;
	}
	fs->uffd = uffd;
	fs->gate = gate;
	char path[64];
	snprintf(path, sizeof path, "/proc/self/fdinfo/%d", uffd);
	fs->fdinfo = open(path, O_RDONLY | O_CLOEXEC);
	fs->around = around ? around : 1;
	fs->ps = sysconf(_SC_PAGESIZE);
	fs->store_fd = -1;
	fs->pagemap = -1;
	fs->zero = MAP_FAILED;
	fs->stopfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	fs->evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	fs->ifd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	fs->bounce_buf = aligned_alloc((size_t)fs->ps, (size_t)fs->ps);
	if (fs->stopfd >= 0 && fs->evfd >= 0 && fs->ifd >= 0 && fs->bounce_buf)
		fs->zero = mmap(NULL, (size_t)fs->ps * fs->around, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	pthread_mutex_init(&fs->qmu, NULL);
	pthread_mutex_init(&fs->imu, NULL);
	pthread_mutex_init(&fs->rmu, NULL);
	pthread_mutex_init(&fs->store_mu, NULL);
	// Direct reclaim needs the pagemap (to find present pages) and a scratch area on
	// the userfaultfd (UFFDIO_MOVE moves only into registered ranges); without them
	// the server installs past the budget and counts it.
	fs->pagemap = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
	void *sc = mmap(NULL, (size_t)fs->ps * EVICT_BATCH, PROT_READ | PROT_WRITE,
	                MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (sc != MAP_FAILED) {
		madvise(sc, (size_t)fs->ps * EVICT_BATCH, MADV_NOHUGEPAGE); // like the buffers it takes pages from
		struct uffdio_register reg = {.range = {.start = (uint64_t)sc, .len = (uint64_t)fs->ps * EVICT_BATCH},
		                              .mode = UFFDIO_REGISTER_MODE_MISSING};
		if (ioctl(uffd, UFFDIO_REGISTER, &reg) == 0)
			fs->scratch = fs->scratch_map = sc;
		else
			munmap(sc, (size_t)fs->ps * EVICT_BATCH);
	}
	if (fs->zero == MAP_FAILED) {
		*err = fs->bounce_buf ? errno : ENOMEM;
		goto fail;
	}
	int e = pthread_create(&fs->thread, NULL, loop, fs);
	if (e != 0) {
		*err = e;
		goto fail;
	}
	return fs;
fail:
	if (fs->fdinfo >= 0) close(fs->fdinfo);
	if (fs->stopfd >= 0) close(fs->stopfd);
	if (fs->evfd >= 0) close(fs->evfd);
	if (fs->ifd >= 0) close(fs->ifd);
	if (fs->zero != MAP_FAILED) munmap(fs->zero, (size_t)fs->ps * fs->around);
	free(fs->bounce_buf);
	release_reclaim(fs);
	pthread_mutex_destroy(&fs->qmu);
	pthread_mutex_destroy(&fs->imu);
	pthread_mutex_destroy(&fs->rmu);
	free(fs);
	return NULL;
}

void odp_fs_stop(odp_fs *fs) {
	uint64_t one = 1;
	ssize_t w = write(fs->stopfd, &one, sizeof one);
	(void)w;
	pthread_join(fs->thread, NULL);
	gate_open(fs); // no DMA waits for a stopped server
	if (fs->fdinfo >= 0)
		close(fs->fdinfo);
	close(fs->stopfd);
	close(fs->evfd);
	munmap(fs->zero, (size_t)fs->ps * fs->around);
	release_reclaim(fs);
	pthread_mutex_destroy(&fs->qmu);
	pthread_mutex_destroy(&fs->rmu);
	pthread_mutex_destroy(&fs->imu);
	close(fs->ifd);
	for (install_req *q = fs->ihead; q;) {
		install_req *n = q->link;
		uint64_t stopped = ODP_INSTALL_STOPPED;
		ssize_t w = write(q->done_fd, &stopped, sizeof stopped); // fail the waiter
		(void)w;
		free(q);
		q = n;
	}
	// Region state arrays belong to their Go owners (odp_region_free).
	free(fs->bounce_buf);
	free(fs->q);
	free(fs);
}

int odp_fs_set_store(odp_fs *fs, int fd) {
	fs->store_fd = fd;
	return 0;
}

uint32_t *odp_region_alloc(uint64_t npages) { return calloc(3 * ((size_t)npages ? (size_t)npages : 1), sizeof(uint32_t)); }

void odp_region_free(uint32_t *state) { free(state); }

int odp_fs_add_region(odp_fs *fs, uint64_t base, uint64_t npages, uint64_t bounce, uint64_t store_off, uint32_t *state) {
	pthread_mutex_lock(&fs->rmu);
	for (int i = 0; i < MAX_REGIONS; i++) {
		region *r = &fs->regions[i];
		if (r->used)
			continue;
		r->state = state;
		r->ref = state + npages;
		r->evictable = state + 2 * npages;
		r->base = base;
		r->npages = npages;
		r->bounce = bounce;
		r->store_off = store_off;
		__atomic_store_n(&r->used, 1, __ATOMIC_RELEASE);
		pthread_mutex_unlock(&fs->rmu);
		return i;
	}
	pthread_mutex_unlock(&fs->rmu);
	return -1;
}

void odp_fs_remove_region(odp_fs *fs, int slot, uint32_t *state) {
	pthread_mutex_lock(&fs->rmu); // the server thread holds it while working on a batch
	region *r = &fs->regions[slot];
	if (r->used && r->state == state) {
		__atomic_store_n(&r->used, 0, __ATOMIC_RELEASE);
		r->state = r->ref = r->evictable = NULL;
	}
	pthread_mutex_unlock(&fs->rmu);
}

uint64_t odp_fs_restored(odp_fs *fs) { return __atomic_load_n(&fs->restored, __ATOMIC_RELAXED); }

void odp_fs_stats_read(odp_fs *fs, odp_fs_stats *out) {
	uint64_t *src = (uint64_t *)&fs->st, *dst = (uint64_t *)out;
	for (size_t i = 0; i < sizeof(*out) / sizeof(uint64_t); i++)
		dst[i] = __atomic_load_n(&src[i], __ATOMIC_RELAXED);
	out->events = __atomic_load_n(&fs->gate->events, __ATOMIC_RELAXED); // counted in the gate
}

int odp_fs_event_fd(odp_fs *fs) { return fs->evfd; }

uint64_t odp_fs_now_ns(void) { return now_ns(); }

int *odp_fs_reading_word(odp_fs *fs) { return &fs->reading; }

void odp_fs_set_evictable(odp_fs *fs, int slot, uint32_t *state, uint64_t first, uint64_t n, int on) {
	pthread_mutex_lock(&fs->rmu); // held by the server thread while it evicts
	region *r = &fs->regions[slot];
	if (r->used && r->state == state && first <= r->npages && n <= r->npages - first) {
		for (uint64_t i = first; i < first + n; i++)
			__atomic_store_n(&r->evictable[i], (uint32_t)(on != 0), __ATOMIC_RELEASE);
		if (on)
			fs->reclaim_idle = 0; // there may be victims now
	}
	pthread_mutex_unlock(&fs->rmu);
}

void odp_fs_set_budget(odp_fs *fs, int64_t pages) { __atomic_store_n(&fs->budget, pages, __ATOMIC_RELEASE); }

int64_t odp_fs_resident(odp_fs *fs) { return __atomic_load_n(&fs->resident, __ATOMIC_ACQUIRE); }

void odp_fs_add_resident(odp_fs *fs, int64_t delta) { resident_add(fs, delta); }

void odp_fs_set_resident(odp_fs *fs, int64_t pages) { __atomic_store_n(&fs->resident, pages, __ATOMIC_RELEASE); }

static void punch(odp_fs *fs, uint64_t off) {
	if (fs->store_fd >= 0) // a failure only leaves the space allocated
		fallocate(fs->store_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)fs->ps);
}

int odp_fs_unstore(odp_fs *fs, uint32_t *word, uint64_t off) {
	pthread_mutex_lock(&fs->store_mu);
	uint32_t want = ODP_PAGE_STORED;
	int ok = __atomic_compare_exchange_n(word, &want, ODP_PAGE_NONE, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
	if (ok)
		punch(fs, off);
	pthread_mutex_unlock(&fs->store_mu);
	return ok;
}

void odp_fs_punch_unless_stored(odp_fs *fs, uint32_t *word, uint64_t off) {
	pthread_mutex_lock(&fs->store_mu);
	if (__atomic_load_n(word, __ATOMIC_ACQUIRE) != ODP_PAGE_STORED)
		punch(fs, off);
	pthread_mutex_unlock(&fs->store_mu);
}

int odp_fs_store_evicted(odp_fs *fs, uint32_t *word, uint64_t off, const void *buf) {
	pthread_mutex_lock(&fs->store_mu);
	int r = 0;
	if (__atomic_load_n(word, __ATOMIC_ACQUIRE) == ODP_PAGE_EVICTING) {
		r = fs->store_fd >= 0 && pwrite(fs->store_fd, buf, (size_t)fs->ps, (off_t)off) == fs->ps ? 1 : -1;
		uint32_t want = ODP_PAGE_EVICTING;
		if (r == 1 && !__atomic_compare_exchange_n(word, &want, ODP_PAGE_STORED, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
			r = 0; // a fault took it back during the write: the copy is not needed
	}
	pthread_mutex_unlock(&fs->store_mu);
	return r;
}
