package suite

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A claim that holds is printed; one that does not, or one the run does not have,
// stops LaTeX naming it. The summary lists both with their evidence.
func TestClaimsStopTheBuild(t *testing.T) {
	dir := t.TempDir()
	rep := &Report{Dir: dir, Headlines: []Headline{
		{Experiment: "oneshot", What: "ratio", Value: "0.91x", Interval: "0.85x–0.97x", Detail: "medians"},
		{Experiment: "oneshot", What: "count", Value: "3 of 4", Detail: "runs"},
	}, Claims: []Claim{
		{Experiment: "oneshot", Name: "yes", Text: "ODP is faster at 1 GiB", Holds: true, Evidence: "0.9"},
		{Experiment: "oneshot", Name: "no", Text: "ODP is faster at 4 KiB", Holds: false, Evidence: "ratio 1.30 at 4 KiB"},
	}}
	numbers := filepath.Join(dir, "numbers.tex")
	require.NoError(t, WriteTeX(rep, numbers))
	require.NoError(t, writeSummary(rep))
	b, err := os.ReadFile(filepath.Join(dir, "summary.md"))
	require.NoError(t, err)
	assert.Contains(t, string(b), "| oneshot | ODP is faster at 4 KiB | **no** | ratio 1.30 at 4 KiB |")
	assert.Contains(t, string(b), "| oneshot | ODP is faster at 1 GiB | yes | 0.9 |")

	if _, err := exec.LookPath("pdflatex"); err != nil {
		t.Skip("no pdflatex to build with (Debian: texlive-latex-base):", err)
	}
	build := func(use string) (string, error) {
		doc := filepath.Join(dir, "doc.tex")
		require.NoError(t, os.WriteFile(doc, []byte("\\documentclass{article}\\begin{document}\\input{numbers.tex}"+use+
			"\\end{document}\n"), 0o644))
		cmd := exec.Command("pdflatex", "-interaction=nonstopmode", "-halt-on-error", "doc.tex")
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	out, err := build("\\claim{oneshot}{yes}. \\result{oneshot}{1} (\\resultci{oneshot}{1}) \\resultci{oneshot}{2}. " +
		"\\begin{tabular}{llll}\\resultstable\\end{tabular}")
	require.NoError(t, err, out)
	out, err = build("\\claim{oneshot}{no}.")
	require.Error(t, err, "a false claim builds")
	assert.Contains(t, out, "claim oneshot/no does not hold for this run") // TeX wraps the rest
	out, err = build("\\claim{oneshot}{maybe}.")
	require.Error(t, err, "a claim the run lacks builds")
	assert.Contains(t, out, "no claim oneshot/maybe in this run")
}
