package main

import (
	"io"

	"github.com/schollz/progressbar/v3"
)

// progress draws a progress bar on stderr for long comparisons.
type progress struct{ bar *progressbar.ProgressBar }

func newProgress(w io.Writer, desc string) *progress {
	return &progress{bar: progressbar.NewOptions(-1, progressbar.OptionSetWriter(w), progressbar.OptionSetDescription(desc),
		progressbar.OptionShowCount(), progressbar.OptionSetElapsedTime(true), progressbar.OptionClearOnFinish())}
}

func (p *progress) update(done, total int) {
	if p.bar.GetMax() != total {
		p.bar.ChangeMax(total)
	}
	p.bar.Set(done)
}

func (p *progress) finish() { p.bar.Finish() }
