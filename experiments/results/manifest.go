package results

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/odpemu/odpemu/pagefault"
	"golang.org/x/sys/unix"
)

// Manifest records where and how a run was made: enough to tell whether two runs'
// numbers may be compared.
type Manifest struct {
	Started  time.Time     `json:"started"`
	WallTime time.Duration `json:"wall_time_ns"`
	Command  []string      `json:"command"`
	Machine  Machine       `json:"machine"`
	Go       string        `json:"go_version"`
	// Revision is the git commit the binary was built from ("+dirty" when the tree
	// had changes), "" when unknown.
	Revision string `json:"git_revision"`
	// Config is the run's configuration: the size, the experiments, their
	// parameters, the seeds.
	Config any `json:"config"`
	// Experiments lists each experiment's files and wall time.
	Experiments []ExperimentRecord `json:"experiments"`
	// Steal is the share of the machine's CPU time the hypervisor gave to other
	// guests during the run (/proc/stat's steal over all of its columns); nil when
	// the kernel did not say, or the run is older than the field: on a VM, how much
	// of the run's time was not its own.
	Steal *float64 `json:"steal_share,omitempty"`
}

// CPUTimes is /proc/stat's line for all CPUs: the time spent in each state, in
// clock ticks since boot.
type CPUTimes struct {
	Total, Steal uint64
}

// ReadCPUTimes reads the machine's CPU times from /proc/stat.
func ReadCPUTimes() (CPUTimes, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return CPUTimes{}, err
	}
	return parseCPUTimes(b)
}

// parseCPUTimes parses /proc/stat's first line: "cpu" and user, nice, system,
// idle, iowait, irq, softirq, steal, guest and guest_nice ticks (guest time is
// counted in user and nice, so it is not added again).
func parseCPUTimes(b []byte) (CPUTimes, error) {
	line, _, _ := bytes.Cut(b, []byte("\n"))
	f := strings.Fields(string(line))
	if len(f) < 9 || f[0] != "cpu" {
		return CPUTimes{}, fmt.Errorf("results: /proc/stat: no steal column in %q", line)
	}
	var t CPUTimes
	for i, v := range f[1:min(len(f), 9)] {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return CPUTimes{}, fmt.Errorf("results: /proc/stat: %w", err)
		}
		t.Total += n
		if i == 7 {
			t.Steal = n
		}
	}
	return t, nil
}

// StealShare is the share of CPU time stolen between two readings, nil when no time
// passed between them.
func StealShare(before, after CPUTimes) *float64 {
	if after.Total <= before.Total || after.Steal < before.Steal {
		return nil
	}
	share := float64(after.Steal-before.Steal) / float64(after.Total-before.Total)
	return &share
}

// ExperimentRecord is one experiment's entry in the manifest.
type ExperimentRecord struct {
	Name     string        `json:"name"`
	WallTime time.Duration `json:"wall_time_ns"`
	Files    []string      `json:"files"`
	// Figures says what each figure shows, by the figure's name (its files' base
	// name).
	Figures map[string]string `json:"figures,omitempty"`
	Rows    int               `json:"rows"`
	Error   string            `json:"error,omitempty"`
}

// Machine describes the machine a run was made on.
type Machine struct {
	Kernel      string `json:"kernel"`
	CPU         string `json:"cpu"`
	Cores       int    `json:"cores"`
	GOMAXPROCS  int    `json:"gomaxprocs"`
	MemoryBytes uint64 `json:"memory_bytes"`
	THP         string `json:"transparent_hugepages"`
	// Userfaultfd is the userfaultfd mode this process gets and the features the
	// kernel offers ("|"-separated UFFD_FEATURE_ names), or why there is none.
	UserfaultfdMode     string `json:"userfaultfd_mode"`
	UserfaultfdFeatures string `json:"userfaultfd_features"`
	UserfaultfdError    string `json:"userfaultfd_error,omitempty"`
}

// String is the machine in one line, for summaries and logs.
func (m Machine) String() string {
	return fmt.Sprintf("Linux %s, %s, %d cores, %d GiB, THP %s, userfaultfd %s", m.Kernel, m.CPU, m.Cores,
		(m.MemoryBytes+1<<29)>>30, m.THP, cmp.Or(m.UserfaultfdMode, "none"))
}

// Describe reads the machine's description from the kernel.
func Describe() Machine {
	k := pagefault.ProbeKernelBehaviour()
	m := Machine{Cores: runtime.NumCPU(), GOMAXPROCS: runtime.GOMAXPROCS(0), CPU: cpuModel(), THP: k.THP}
	if m.THP == "" {
		m.THP = "none"
	}
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		m.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) == nil {
		m.MemoryBytes = uint64(si.Totalram) * uint64(si.Unit)
	}
	if u := k.Userfaultfd; u.Err != nil {
		m.UserfaultfdError = u.Err.Error()
	} else {
		m.UserfaultfdMode, m.UserfaultfdFeatures = u.Mode.String(), u.Features.String()
	}
	return m
}

// cpuModel is /proc/cpuinfo's first "model name".
func cpuModel() string {
	f, err := os.Open("/proc/cpuinfo")
	if err != nil {
		return "unknown"
	}
	defer func() { _ = f.Close() }() // read-only
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown"
}

// Revision returns the git commit of the build (from the binary's build
// information, else from git in the working directory), "" when unknown.
func Revision() string {
	if bi, ok := debug.ReadBuildInfo(); ok {
		var rev, dirty string
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				if s.Value == "true" {
					dirty = "+dirty"
				}
			}
		}
		if rev != "" {
			return rev + dirty
		}
	}
	out, err := exec.Command("git", "rev-parse", "HEAD").Output()
	if err != nil {
		return ""
	}
	rev := string(bytes.TrimSpace(out))
	if st, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(st) > 0 {
		rev += "+dirty"
	}
	return rev
}

// Write writes the manifest to dir/manifest.json.
func (m *Manifest) Write(dir string) error {
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "manifest.json"), append(b, '\n'), 0o644)
}

// ReadManifest reads the manifest.json of the run in dir.
func ReadManifest(dir string) (*Manifest, error) {
	b, err := os.ReadFile(filepath.Join(dir, "manifest.json"))
	if err != nil {
		return nil, fmt.Errorf("results: %w", err)
	}
	var m Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("%w: %s/manifest.json: %w", ErrSchema, dir, err)
	}
	return &m, nil
}
