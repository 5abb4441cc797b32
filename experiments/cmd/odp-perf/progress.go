package main

import (
	"fmt"
	"io"
	"os"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"
)

// progress reports a long comparison's progress: a bar when w is a terminal, a short
// line per finished step otherwise (a file or a pipe gets no redraws).
type progress struct {
	bar   *progressbar.ProgressBar // nil when w is not a terminal
	w     io.Writer
	desc  string
	start time.Time
}

func newProgress(w io.Writer, desc string) *progress {
	p := &progress{w: w, desc: desc, start: time.Now()}
	if f, ok := w.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		p.bar = progressbar.NewOptions(-1, progressbar.OptionSetWriter(w), progressbar.OptionSetDescription(desc),
			progressbar.OptionShowCount(), progressbar.OptionSetElapsedTime(true), progressbar.OptionClearOnFinish())
	}
	return p
}

func (p *progress) update(done, total int) {
	if p.bar == nil {
		fmt.Fprintf(p.w, "%s: %d/%d runs done (%s)\n", p.desc, done, total, time.Since(p.start).Round(time.Second))
		return
	}
	if p.bar.GetMax() != total {
		p.bar.ChangeMax(total)
	}
	_ = p.bar.Set(done) // drawing errors only lose a frame of the bar
}

func (p *progress) finish() {
	if p.bar != nil {
		_ = p.bar.Finish()
	}
}
