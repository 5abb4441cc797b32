package suite

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/odpemu/odpemu/experiments/plots"
	"github.com/odpemu/odpemu/experiments/results"
	"github.com/odpemu/odpemu/experiments/stats"
	"github.com/odpemu/odpemu/fusefs"
	"github.com/odpemu/odpemu/internal/fusemount"
	"github.com/odpemu/odpemu/odp"
)

var fileBacked = Experiment{
	Name:  "filebacked",
	Title: "MRs over a file served through FUSE: registration, first byte and sparse READs, pinned vs ODP; pages after a file change",
	Run:   runFileBacked,
	Replot: func(x *X) error {
		size, err := x.loadedParam("file_bytes")
		if err != nil {
			return err
		}
		return replot(x, "", func(t *results.Table) error {
			st, err := x.Loaded("filebacked_stale")
			if err != nil {
				return err
			}
			return fileBackedReport(x, t, st, int(size), floats(t, "fraction"))
		})
	},
}

// fileMsg is the size of one READ of the file.
const fileMsg = 64 << 10

// fileRun is one registration of the file and READs of a fraction of it.
type fileRun struct {
	register, firstByte, total time.Duration
	reads                      int
	fsBytes, faults            uint64
}

// fileSetup is the mounted file and a rig whose server maps it.
type fileSetup struct {
	dir   string // the mount point's parent, removed by close after the unmount
	fsys  *fusefs.FS
	file  *fusefs.File
	obj   *fusefs.Synthetic
	fd    *os.File
	rig   *bufferRig
	local []byte
	lkey  uint32
	size  int
}

// newFileSetup (FUSE must be available) mounts a filesystem in a fresh directory with one synthetic file of
// size bytes, opens a rig (with cfg) whose server device watches it, and a local
// buffer of one message on the client. close undoes it all.
func newFileSetup(size int, seed uint64, cfg odp.Config) (_ *fileSetup, err error) {
	dir, err := os.MkdirTemp("", "odpemu-filebacked-")
	if err != nil {
		return nil, err
	}
	s := &fileSetup{dir: dir, size: size, obj: fusefs.NewSynthetic(int64(size), seed)}
	defer func() {
		if err != nil {
			s.close()
		}
	}()
	if s.fsys, err = fusefs.Mount(filepath.Join(dir, "mnt"), fusefs.Options{}); err != nil {
		return nil, err
	}
	if s.file, err = s.fsys.Add("object", s.obj); err != nil {
		return nil, err
	}
	if s.fd, err = os.Open(s.file.Path()); err != nil {
		return nil, err
	}
	if s.rig, err = newBufferRig(cfg, fileMsg); err != nil {
		return nil, err
	}
	s.fsys.Watch(s.rig.server)
	if s.local, err = s.rig.client.Alloc(fileMsg); err != nil {
		return nil, err
	}
	mr, err := s.rig.pd.RegMR(s.local, odp.AccessLocalWrite)
	if err != nil {
		return nil, err
	}
	s.lkey = mr.LKey()
	return s, nil
}

func (s *fileSetup) close() {
	if s.rig != nil {
		s.rig.close() // unmaps the file mappings
	}
	if s.fd != nil {
		_ = s.fd.Close()
	}
	if s.fsys != nil {
		_ = s.fsys.Unmount() // aborted if busy: nothing of ours is left mounted
	}
	_ = os.RemoveAll(s.dir) // the empty mount point, no longer busy
}

// register maps the file and registers it, pinned or on demand.
func (s *fileSetup) register(onDemand bool) ([]byte, *odp.MR, error) {
	mem, err := s.rig.server.MapFile(s.fd, 0, s.size, false)
	if err != nil {
		return nil, nil, err
	}
	access := odp.AccessRemoteRead
	if onDemand {
		access |= odp.AccessOnDemand
	}
	mr, err := s.rig.spd.RegMR(mem, access)
	if err != nil {
		_ = s.rig.server.Free(mem)
		return nil, nil, err
	}
	return mem, mr, nil
}

func (s *fileSetup) release(mem []byte, mr *odp.MR) error {
	if err := mr.Dereg(); err != nil {
		return err
	}
	return s.rig.server.Free(mem)
}

// access registers the file with a cold page cache and READs the chunks (of fileMsg
// bytes) listed, timing it all from the registration on.
func (s *fileSetup) access(onDemand bool, chunks []int) (fileRun, error) {
	var r fileRun
	if err := s.file.DropCache(); err != nil {
		return r, err
	}
	before := s.fsys.Stats().BytesRead
	t0 := time.Now()
	mem, mr, err := s.register(onDemand)
	if err != nil {
		return r, err
	}
	r.register = time.Since(t0)
	for i, c := range chunks {
		if err := s.rig.read(s.local, s.lkey, mr.Addr()+uint64(c*fileMsg), mr.RKey()); err != nil {
			return r, err
		}
		if i == 0 {
			r.firstByte = time.Since(t0)
		}
	}
	r.total = time.Since(t0)
	r.reads = len(chunks)
	r.fsBytes = s.fsys.Stats().BytesRead - before
	r.faults = mr.Stats().PageFaults
	return r, s.release(mem, mr)
}

func runFileBacked(x *X) error {
	if err := fusemount.Available(); err != nil {
		// Not a failure of the suite: the machine cannot mount (no /dev/fuse, not root).
		x.Param("skipped", err.Error())
		x.Headline("skipped", "-", err.Error())
		return nil
	}
	size := pick(x.Scale, 16<<20, 1<<30, 1<<30)
	for size > 16<<20 && size > memoryCap() {
		size /= 2
	}
	fractions := []float64{0.01, 0.1, 1}
	reps := pick(x.Scale, 2, 3, fullReps)
	const changed = 16
	x.Param("file_bytes", size)
	x.Param("read_bytes", fileMsg)
	x.Param("fractions", fractions)
	x.Param("reps", reps)
	x.Param("pages_changed", changed)
	x.Steps(reps*len(fractions) + 1)
	t := x.Table("", "fraction", "method", "rep", "register_ns", "first_byte_ns", "total_ns", "reads", "fs_bytes_read", "page_faults")
	s, err := newFileSetup(size, x.Seed, x.device(odp.Config{}))
	if err != nil {
		return err
	}
	defer s.close()
	rng := rand.New(rand.NewPCG(x.Seed, 11))
	nchunks := size / fileMsg
	for rep := range reps {
		perm := rng.Perm(nchunks) // the chunks read, in order, the same for both methods
		for _, fr := range fractions {
			chunks := perm[:max(1, int(fr*float64(nchunks)))]
			order := []bool{false, true}
			if rep%2 == 1 {
				order = []bool{true, false}
			}
			for _, onDemand := range order {
				r, err := s.access(onDemand, chunks)
				if err != nil {
					return fmt.Errorf("%v of the file, ODP %v: %w", fr, onDemand, err)
				}
				method := "pinned"
				if onDemand {
					method = "odp"
				}
				if err := t.Add(fr, method, rep, r.register, r.firstByte, r.total, r.reads, r.fsBytes, r.faults); err != nil {
					return err
				}
			}
			x.Step()
		}
	}
	st := x.Table("filebacked_stale", "method", "pages_changed", "reads_new", "reads_old", "stale_dmas", "invalidations")
	if err := staleDemo(x.Seed, size, changed, st); err != nil {
		return err
	}
	x.Step()
	return fileBackedReport(x, t, st, size, fractions)
}

// staleDemo registers the file pinned and on demand (with the DMA audit on), READs
// pages of it through both, changes them in the backing object, and READs them
// again: which MR returns the new bytes, which the old.
func staleDemo(seed uint64, size, changed int, t *results.Table) error {
	s, err := newFileSetup(size, seed, odp.Config{Audit: true})
	if err != nil {
		return err
	}
	defer s.close()
	rng := rand.New(rand.NewPCG(seed, 13))
	pages := rng.Perm(size / odp.PageSize)[:changed]
	type reg struct {
		name string
		mem  []byte
		mr   *odp.MR
	}
	var regs []reg
	for _, onDemand := range []bool{true, false} {
		mem, mr, err := s.register(onDemand)
		if err != nil {
			return err
		}
		name := map[bool]string{true: "odp", false: "pinned"}[onDemand]
		regs = append(regs, reg{name, mem, mr})
	}
	buf := s.local[:odp.PageSize]
	readPage := func(mr *odp.MR, p int) error {
		return s.rig.read(buf, s.lkey, mr.Addr()+uint64(p*odp.PageSize), mr.RKey())
	}
	old := map[int][]byte{}
	for _, p := range pages {
		for _, r := range regs {
			if err := readPage(r.mr, p); err != nil {
				return err
			}
		}
		old[p] = bytes.Clone(buf)
		fresh := bytes.Repeat([]byte{byte(p) | 1}, odp.PageSize)
		for i := range fresh {
			fresh[i] ^= old[p][i] // differs from the old content in every byte
		}
		if err := s.file.Change(int64(p*odp.PageSize), fresh); err != nil {
			return err
		}
	}
	for _, r := range regs {
		var fresh, stale int
		for _, p := range pages {
			if err := readPage(r.mr, p); err != nil {
				return err
			}
			want := make([]byte, odp.PageSize)
			if _, err := s.obj.ReadAt(want, int64(p*odp.PageSize)); err != nil {
				return err
			}
			switch {
			case bytes.Equal(buf, want):
				fresh++
			case bytes.Equal(buf, old[p]):
				stale++
			}
		}
		ms := r.mr.Stats()
		if err := t.Add(r.name, changed, fresh, stale, ms.StaleDMAs, ms.Invalidations); err != nil {
			return err
		}
		if err := s.release(r.mem, r.mr); err != nil {
			return err
		}
	}
	return nil
}

func fileBackedReport(x *X, t, st *results.Table, size int, fractions []float64) error {
	var series []plots.Series
	for _, m := range []struct{ method, col, name string }{
		{"pinned", "total_ns", "pinned: total"}, {"odp", "total_ns", "ODP: total"},
		{"pinned", "first_byte_ns", "pinned: first byte"}, {"odp", "first_byte_ns", "ODP: first byte"},
	} {
		g := plots.Group(t.Rows(results.Where("method", m.method)), "fraction", m.col, "method")
		if len(g) == 1 {
			g[0].Name = m.name
			for i := range g[0].Points {
				g[0].Points[i].X *= 100
			}
			g[0].Dashed = m.col == "first_byte_ns"
			series = append(series, scaleY(g, 1e-6)...)
		}
	}
	err := x.Figure("filebacked", plots.Figure{Title: fmt.Sprintf("A %s file through FUSE, READs of %s", human(size), human(fileMsg)),
		X: plots.Axis{Label: "part of the file READ (%)", Log: true}, Y: plots.Axis{Label: "time from registration (ms)", Log: true},
		Series: series})
	if err != nil {
		return err
	}
	perFraction := func(fr float64, col, over, under string) []float64 {
		return perRep(t, col, sel("fraction", fr, "method", over), sel("fraction", fr, "method", under))
	}
	fb := perFraction(fractions[0], "first_byte_ns", "pinned", "odp")
	x.HeadlineCI(fmt.Sprintf("%s file: time to first byte, pinned / ODP", human(size)), ratio(stats.Median(fb)), ci(fb, ratio),
		fmt.Sprintf("median of %d repetitions; pinned reads the whole file at registration", len(fb)))
	var totals, intervals []string
	for _, fr := range fractions {
		v, i := medianCI(perFraction(fr, "total_ns", "odp", "pinned"), fixed2)
		totals, intervals = append(totals, v), append(intervals, i)
	}
	sparse := stats.Median(perFraction(fractions[0], "total_ns", "odp", "pinned"))
	full := stats.Median(perFraction(fractions[len(fractions)-1], "total_ns", "odp", "pinned"))
	x.Claim("sparsefull", "ODP wins sparse access and loses a full scan", sparse < 1 && full > 1,
		fmt.Sprintf("ODP / pinned total time, medians of per-repetition ratios: %.2f at the sparsest READs, %.2f at a full scan", sparse, full))
	x.HeadlineCI("total time, READs of 1% / 10% / 100% of the file: ODP / pinned", strings.Join(totals, " / "), strings.Join(intervals, " / "),
		"medians of per-repetition ratios, registration included, page cache dropped before each run; every ODP READ of a new chunk takes a fault and an RNR NAK")
	fsb := perFraction(fractions[0], "fs_bytes_read", "pinned", "odp")
	x.HeadlineCI("bytes the filesystem read for READs of 1% of the file: pinned / ODP", ratio(stats.Median(fsb)), ci(fsb, ratio),
		"ODP's include the kernel's readahead around each fault")
	var demo []string
	for _, r := range st.Rows(nil) {
		demo = append(demo, fmt.Sprintf("%s %s of %s new (%s old, audit: %s stale DMAs)", r.Get("method"), r.Get("reads_new"),
			r.Get("pages_changed"), r.Get("reads_old"), r.Get("stale_dmas")))
	}
	x.Headline("READs of changed pages after the file changed", strings.Join(demo, "; "),
		"pages changed in the backing object through the filesystem; a pinned MR keeps the pages it pinned")
	reg := perFraction(fractions[0], "register_ns", "pinned", "odp")
	x.HeadlineCI(fmt.Sprintf("registration of the %s file: pinned / ODP", human(size)), ratio(stats.Median(reg)), ci(reg, ratio),
		fmt.Sprintf("median of %d repetitions, page cache cold", len(reg)))
	return nil
}
