package odp

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"

	"github.com/odpemu/odpemu/internal/interval"
	"github.com/odpemu/odpemu/invalidate"
	"github.com/odpemu/odpemu/pagefault"
	"github.com/odpemu/odpemu/paging"
	"golang.org/x/sys/unix"
)

// space is the process's address space as the NICs see it, the kernel's mm: one
// userfaultfd with its CPU fault server, DMA gate and event pump, one notifier
// registry, the pager, and the record of the buffers odpemu mapped, of the ranges ODP
// MRs registered for faults and of the ranges pinned MRs locked. Every Device opened
// with the same address-space settings (spaceConfig) shares one, as every NIC of a
// process shares its mm: a buffer from one device's Alloc can be registered on any of
// them, ODP or pinned, each device with its own tables, keys and counters, and an
// invalidation reaches the MRs of all of them, as mlx5 and rxe subscribe interval
// notifiers to the same mm. (The kernel allows a range to be registered with one
// userfaultfd only: devices opened with different settings, an ablation or a paging
// budget, get spaces of their own and cannot share buffers.)
type space struct {
	cfg  spaceConfig
	refs int // devices using it; protected by spacesMu

	uffd     *pagefault.FD
	server   *pagefault.CPUServer
	gate     *pagefault.Gate // the server's DMA gate
	pagemap  *pagefault.Pagemap
	resolver *pagefault.Resolver
	registry *invalidate.Registry
	pump     *invalidate.Pump
	pager    *paging.Pager // nil unless paging
	store    *paging.Store
	barrier  *pagefault.ZapBarrier
	// noODP is why the space has no userfaultfd (uffd, server, resolver and barrier
	// are nil; wraps pagefault.ErrRefused), nil in a space that has one.
	noODP  error
	silent *noEvents  // the pump's source in a space without a userfaultfd
	zaps   zapWindow  // REMOVE ranges whose zap may be late (latezap.go)
	regMu  sync.Mutex // serialises ODP userfaultfd registration changes

	mu      sync.RWMutex     // protects the fields below; read-locked for lookups
	buffers []buffer         // sorted by start
	odpRegs []interval.Range // userfaultfd-registered ranges, one per ODP MR
	locked  []interval.Range // mlocked ranges, one per pinned MR
	files   []fileMap        // file mappings (MapFile), sorted by start
	// fileRegs are the ranges of ODP MRs over file mappings, one per MR.
	fileRegs []interval.Range
	// foreignRegs are the ranges of ODP MRs over the application's own memory, one
	// per MR (registered for events only; pages stay registered while one covers them).
	foreignRegs []interval.Range
	// implicitMRs are the implicit ODP MRs of all devices: while there is one, every
	// buffer is registered for faults.
	implicitMRs []remapper
}

// remapper is an implicit ODP MR as the address space sees it: it covers every
// buffer, and is told of each new one (remap), whatever was mapped there before, and
// of the application's memory unmapped or moved away (leftLocked, with space.mu held).
type remapper interface {
	remap(start, end uintptr)
	leftLocked(r interval.Range)
}

// spaceConfig are the settings that belong to the address space, not to a device.
type spaceConfig struct {
	UserModeOnly   bool
	NoInvalidate   bool
	Paging         bool
	CPUFaultAround int
	ResidentBudget int64
	StorePath      string
}

func (c Config) space() spaceConfig {
	return spaceConfig{UserModeOnly: c.UserModeOnly, NoInvalidate: c.NoInvalidate, Paging: c.Paging || c.ResidentBudget > 0,
		CPUFaultAround: c.CPUFaultAround, ResidentBudget: c.ResidentBudget, StorePath: c.StorePath}
}

var (
	spacesMu sync.Mutex
	spaces   = map[spaceConfig]*space{}
)

// acquireSpace returns the address space for cfg, starting it if no device uses one.
func acquireSpace(cfg spaceConfig) (*space, error) {
	spacesMu.Lock()
	defer spacesMu.Unlock()
	if s := spaces[cfg]; s != nil {
		s.refs++
		return s, nil
	}
	s, err := startSpace(cfg)
	if err != nil {
		return nil, err
	}
	s.refs = 1
	spaces[cfg] = s
	return s, nil
}

func startSpace(cfg spaceConfig) (*space, error) {
	s := &space{cfg: cfg}
	var err error
	feats := pagefault.FeatureEventRemove | pagefault.FeatureEventUnmap | pagefault.FeatureEventRemap
	if p := pagefault.ProbeKernel(); p.Err == nil && p.Mode == pagefault.ModeKernel && !cfg.UserModeOnly {
		feats |= pagefault.FeatureEventFork // needs CAP_SYS_PTRACE
	}
	if s.uffd, err = pagefault.Open(pagefault.Options{Features: feats, UserModeOnly: cfg.UserModeOnly}); err != nil && feats&pagefault.FeatureEventFork != 0 {
		feats &^= pagefault.FeatureEventFork
		s.uffd, err = pagefault.Open(pagefault.Options{Features: feats, UserModeOnly: cfg.UserModeOnly})
	}
	if err != nil {
		if errors.Is(err, pagefault.ErrRefused) && !cfg.Paging {
			return s.startPinnedOnly(err)
		}
		return nil, err
	}
	if s.pagemap, err = pagefault.OpenPagemap(); err == nil {
		if s.server, err = pagefault.StartCPUServer(s.uffd, cfg.CPUFaultAround); err == nil {
			s.gate = s.server.Gate()
			s.registry = invalidate.NewRegistry()
			s.registry.SetDisabled(cfg.NoInvalidate)
			if s.barrier, err = pagefault.NewZapBarrier(s.uffd); err == nil {
				s.pump, err = invalidate.StartPump(s.server, s.registry, cfg.NoInvalidate)
			}
			if err == nil {
				s.pump.SetHook(s.noteEvent)
				s.pump.SetBarrier(s.barrier.Wait)
				if cfg.Paging {
					if cfg.StorePath != "" {
						s.store, err = paging.NewFileStore(cfg.StorePath)
					} else {
						s.store, err = paging.NewMemStore()
					}
					if err == nil {
						s.pager = paging.NewPager(s.uffd, s.server, s.registry, s.pagemap, s.store,
							paging.PagerConfig{Budget: cfg.ResidentBudget, Eligible: s.evictable})
					}
				}
				if err == nil {
					s.resolver, err = pagefault.NewResolver(s.uffd, s.pagemap, pagefault.ZeroSource{})
				}
			}
		}
	}
	if err != nil {
		_ = s.stop() // the error that made the start fail is the one to report
		return nil, err
	}
	return s, nil
}

// startPinnedOnly starts the address space of a process that may not create a
// userfaultfd (why): no fault server, resolver or zap barrier. The DMA gate is one
// that nothing closes and the pump reads a source with no events, so that DMAs take
// the paths they take in every space; ODP registrations are refused (noODP).
func (s *space) startPinnedOnly(why error) (*space, error) {
	s.noODP = why
	var err error
	if s.pagemap, err = pagefault.OpenPagemap(); err == nil {
		if s.gate = pagefault.NewGate(); s.gate == nil {
			err = wrap(ErrNoMemory, "a DMA gate")
		}
	}
	if err == nil {
		s.registry = invalidate.NewRegistry()
		s.registry.SetDisabled(s.cfg.NoInvalidate)
		if s.silent, err = newNoEvents(); err == nil {
			s.pump, err = invalidate.StartPump(s.silent, s.registry, s.cfg.NoInvalidate)
		}
	}
	if err != nil {
		_ = s.stop() // the error that made the start fail is the one to report
		return nil, err
	}
	return s, nil
}

// noEvents is the event source of a space without a userfaultfd: nothing is
// registered, so nothing is reported, and its eventfd never becomes readable.
type noEvents struct{ fd int }

func newNoEvents() (*noEvents, error) {
	fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("odp: eventfd: %w", err)
	}
	return &noEvents{fd: fd}, nil
}

func (n *noEvents) EventFd() (int, error)               { return n.fd, nil }
func (n *noEvents) Events([]pagefault.Msg) (int, error) { return 0, nil }
func (n *noEvents) SettledEvents() (uint64, error)      { return 0, nil }
func (n *noEvents) Close() error                        { return unix.Close(n.fd) }

// stop stops and closes what startSpace started, in reverse order, and returns what
// failed. Parts that were never started are skipped.
func (s *space) stop() error {
	var errs []error
	if s.pager != nil {
		s.pager.Close()
	}
	if s.pump != nil {
		s.pump.Stop()
	}
	if s.silent != nil {
		errs = append(errs, s.silent.Close())
	}
	if s.server != nil {
		errs = append(errs, s.server.Stop())
	}
	if s.barrier != nil {
		errs = append(errs, s.barrier.Close())
	}
	if s.resolver != nil {
		errs = append(errs, s.resolver.Close())
	}
	if s.pagemap != nil {
		errs = append(errs, s.pagemap.Close())
	}
	if s.uffd != nil {
		errs = append(errs, s.uffd.Close())
	}
	if s.store != nil {
		errs = append(errs, s.store.Close())
	}
	return errors.Join(errs...)
}

// release is a device's Close of the space: the buffers the device allocated that no
// MR of another device covers are unmapped now (as a device's Close always did);
// the last device stops the space and unmaps what remains. Buffers are left mapped if
// the events that tell which of their parts the application unmapped could not be
// read.
func (s *space) release(d any, name string) error {
	syncErr := s.pump.Sync() // holes the application made are recorded before buffers are unmapped
	spacesMu.Lock()
	defer spacesMu.Unlock()
	s.refs--
	last := s.refs == 0
	var errs []error
	s.mu.Lock()
	mine, keptBuffers := splitOwnedLocked(s, d, last, s.buffers, func(b *buffer) *any { return &b.owner })
	files, keptFiles := splitOwnedLocked(s, d, last, s.files, func(fm *fileMap) *any { return &fm.owner })
	s.buffers, s.files = keptBuffers, keptFiles
	s.mu.Unlock()
	for _, fm := range files {
		errs = append(errs, fm.unmap())
	}

	if syncErr != nil {
		errs = append(errs, fmt.Errorf("odp: close %s: buffers left mapped, events unknown: %w", name, syncErr))
	}
	if !last {
		if syncErr == nil {
			for _, b := range mine {
				errs = append(errs, s.retire(b, true))
			}
		}
		return errors.Join(errs...)
	}
	delete(spaces, s.cfg)
	if s.pager != nil {
		s.pager.Close()
	}
	for _, b := range mine {
		if b.paged != nil {
			errs = append(errs, b.paged.Remove())
		}
	}
	errs = append(errs, s.stop())
	if syncErr == nil {
		for _, b := range mine {
			b.unmap(nil) // the userfaultfd is closed: its registrations went with it
		}
	}
	return errors.Join(errs...)
}

// bounded is what the space's sorted lists hold (buffers, file mappings): a range
// of the address space (an embedded interval.Range).
type bounded interface{ Span() interval.Range }

// insertSorted inserts x into xs, which is sorted by start, and returns the list.
func insertSorted[T bounded](xs []T, x T) []T {
	s := x.Span().Start
	i := sort.Search(len(xs), func(i int) bool { return xs[i].Span().Start > s })
	return slices.Insert(xs, i, x)
}

// holding returns the item of xs (sorted by start) that holds [start, start+n).
func holding[T bounded](xs []T, start, n uintptr) (T, bool) {
	i := sort.Search(len(xs), func(i int) bool { return xs[i].Span().Start > start }) - 1
	if i >= 0 {
		if end := xs[i].Span().End; start+n <= end && start+n >= start {
			return xs[i], true
		}
	}
	var zero T
	return zero, false
}

// startingAt returns the index of the item of xs (sorted by start) that starts at
// start, or -1.
func startingAt[T bounded](xs []T, start uintptr) int {
	i := sort.Search(len(xs), func(i int) bool { return xs[i].Span().Start >= start })
	if i < len(xs) {
		if xs[i].Span().Start == start {
			return i
		}
	}
	return -1
}

// splitOwnedLocked splits a closing device's view of the space's mappings (buffers
// or file mappings): mine are those its Close unmaps (every one when it is the last
// device, else its own that no MR covers), kept those the space keeps; a kept one of
// d's becomes the space's. owner returns an item's owner field. Called with
// space.mu held.
func splitOwnedLocked[T bounded](s *space, d any, last bool, items []T, owner func(*T) *any) (mine, kept []T) {
	for _, it := range items {
		o := owner(&it)
		if last || (*o == d && !s.coveredLocked(it.Span())) {
			mine = append(mine, it)
			continue
		}
		if *o == d {
			*o = nil // the space's now: another device's MR uses it
		}
		kept = append(kept, it)
	}
	return mine, kept
}

// coveredLocked reports whether an MR (ODP or pinned, of any device) covers part of r.
// Called with space.mu held.
func (s *space) coveredLocked(r interval.Range) bool {
	for _, rs := range [][]interval.Range{s.odpRegs, s.locked, s.fileRegs} {
		for _, x := range rs {
			if x.Overlaps(r) {
				return true
			}
		}
	}
	return false
}

// evictable reports whether pages [start, end) may be evicted or migrated: inside
// ODP registrations (so that a later access faults; with an implicit MR every buffer
// is) and in no pinned MR.
func (s *space) evictable(start, end uintptr) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	r := interval.Range{Start: start, End: end}
	if len(s.implicitMRs) == 0 && len(interval.Uncovered(r, s.odpRegs)) > 0 {
		return false
	}
	for _, l := range s.locked {
		if l.Overlaps(r) {
			return false
		}
	}
	return true
}

// syncEvictableLocked tells the fault server's direct reclaim which pages of the
// paged buffers it may evict: those evictable would accept (registered for faults by
// an ODP MR, explicit or implicit; not mlocked by a pinned one). Called with s.mu held,
// after a range became registered for faults and before one stops being so (the
// server then no longer evicts there when it returns).
func (s *space) syncEvictableLocked() {
	if s.pager == nil {
		return
	}
	for _, b := range s.buffers {
		if b.paged == nil {
			continue
		}
		whole := b.Range
		on := []interval.Range{whole}
		if len(s.implicitMRs) == 0 {
			on = interval.Uncovered(whole, interval.Uncovered(whole, s.odpRegs))
		}
		var evictable []interval.Range
		for _, r := range on {
			evictable = append(evictable, interval.Uncovered(r, s.locked)...)
		}
		for _, r := range interval.Uncovered(whole, evictable) {
			s.pager.SetEvictable(r.Start, r.End, false)
		}
		for _, r := range evictable {
			s.pager.SetEvictable(r.Start, r.End, true)
		}
	}
}
