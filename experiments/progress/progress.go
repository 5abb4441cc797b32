// Package progress shows a long run's progress: a bar on a terminal, a short line
// per finished step otherwise (a file or a pipe gets no redraws).
package progress

import (
	"fmt"
	"io"
	"os"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"
)

// Bar reports the progress of one task of a known (or growing) number of steps.
type Bar struct {
	bar   *progressbar.ProgressBar // nil when w is not a terminal
	w     io.Writer
	desc  string
	start time.Time
}

// New starts a bar for the task desc on w.
func New(w io.Writer, desc string) *Bar {
	p := &Bar{w: w, desc: desc, start: time.Now()}
	if f, ok := w.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		p.bar = progressbar.NewOptions(-1, progressbar.OptionSetWriter(w), progressbar.OptionSetDescription(desc),
			progressbar.OptionShowCount(), progressbar.OptionSetElapsedTime(true), progressbar.OptionClearOnFinish())
	}
	return p
}

// Update reports done of total steps done.
func (p *Bar) Update(done, total int) {
	if p.bar == nil {
		fmt.Fprintf(p.w, "%s: %d/%d done (%s)\n", p.desc, done, total, time.Since(p.start).Round(time.Second))
		return
	}
	if p.bar.GetMax() != total {
		p.bar.ChangeMax(total)
	}
	_ = p.bar.Set(done) // drawing errors only lose a frame of the bar
}

// Finish ends the bar.
func (p *Bar) Finish() {
	if p.bar != nil {
		_ = p.bar.Finish()
	}
}
