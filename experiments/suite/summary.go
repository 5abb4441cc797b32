package suite

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// writeSummary writes summary.md: the machine, the headline numbers, each linked to
// its experiment's CSV, and every figure.
func writeSummary(rep *Report) error {
	m := rep.Manifest
	var b strings.Builder
	fmt.Fprintf(&b, "# odpemu experiment suite\n\n")
	fmt.Fprintf(&b, "- Machine: %s\n", m.Machine)
	fmt.Fprintf(&b, "- Run: %s, started %s, %s wall time, Go %s, revision %s\n", rep.Scale,
		m.Started.UTC().Format(time.RFC3339), m.WallTime.Round(time.Second), m.Go, orUnknown(m.Revision))
	if c, ok := m.Config.(map[string]any); ok && c["link"] != nil {
		fmt.Fprintf(&b, "- Emulated NICs: link %v; responder faults: %v\n", c["link"], c["responder_faults"])
	}
	if c, ok := m.Config.(map[string]any); ok && c["profile"] != nil {
		fmt.Fprintf(&b, "- Profile: %v (%v); from %v\n", c["profile"], c["profile_settings"], c["profile_source"])
	}
	if m.Steal != nil {
		fmt.Fprintf(&b, "- Steal time: %.1f%% of the machine's CPU time went to other guests during the run\n", 100**m.Steal)
	}
	fmt.Fprintf(&b, "- Files: `manifest.json` records the machine, the configuration and the seeds.\n\n")
	fmt.Fprintf(&b, "## Headlines\n\n| Experiment | Result | Value | 95%% interval | How |\n|---|---|---|---|---|\n")
	csvOf := map[string]string{}
	for _, e := range m.Experiments {
		for _, f := range e.Files {
			if strings.HasSuffix(f, ".csv") && csvOf[e.Name] == "" {
				csvOf[e.Name] = f
			}
		}
	}
	for _, h := range rep.Headlines {
		exp := h.Experiment
		if f := csvOf[exp]; f != "" {
			exp = fmt.Sprintf("[%s](%s)", exp, f)
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s |\n", exp, cell(h.What), cell(h.Value), cell(h.Interval), cell(h.Detail))
	}
	if len(rep.Claims) > 0 {
		fmt.Fprintf(&b, "\n## Claims\n\nWhat the paper says of this run, and whether the run holds it.\n\n| Experiment | Claim | Holds | Evidence |\n|---|---|---|---|\n")
		for _, c := range rep.Claims {
			holds := "yes"
			if !c.Holds {
				holds = "**no**"
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", c.Experiment, cell(c.Text), holds, cell(c.Evidence))
		}
	}
	fmt.Fprintf(&b, "\n## Experiments\n\n")
	for _, e := range m.Experiments {
		status := fmt.Sprintf("%d rows, %s", e.Rows, e.WallTime.Round(100*time.Millisecond))
		if e.Error != "" {
			status += ", **failed**: " + cell(e.Error)
		}
		fmt.Fprintf(&b, "### %s\n\n%s.\n\n", e.Name, status)
		for _, f := range e.Files {
			switch filepath.Ext(f) {
			case ".csv":
				fmt.Fprintf(&b, "- [%s](%s)\n", f, f)
			case ".png":
				name := strings.TrimSuffix(f, ".png")
				if c := e.Figures[name]; c != "" {
					fmt.Fprintf(&b, "\n%s:\n", c)
				}
				fmt.Fprintf(&b, "\n![%s](%s)\n", name, f)
			}
		}
		b.WriteString("\n")
	}
	return os.WriteFile(filepath.Join(rep.Dir, "summary.md"), []byte(b.String()), 0o644)
}

// cell makes s safe inside a Markdown table cell.
func cell(s string) string {
	return strings.NewReplacer("|", `\|`, "\n", " ").Replace(s)
}

func orUnknown(s string) string {
	if s == "" {
		return "unknown"
	}
	return s
}
