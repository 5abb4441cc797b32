package suite

import (
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/odpemu/odpemu/experiments/results"
)

// Replot reads the run in dir (its manifest and CSVs), draws the figures of every
// experiment that completed into out, each in the formats exts (png, svg, pdf), and
// returns the run's report with the headlines computed again from the CSVs: the
// figures and numbers of a paper come from the results files, not from a run's
// memory. Experiments that failed in the run are skipped.
func Replot(dir, out string, exts ...string) (*Report, error) {
	m, err := results.ReadManifest(dir)
	if err != nil {
		return nil, err
	}
	var params map[string]any
	scale := Quick // what a report that depends on it assumes of a run that does not say
	if cfg, ok := m.Config.(map[string]any); ok {
		params, _ = cfg["experiments"].(map[string]any)
		if name, ok := cfg["scale"].(string); ok {
			if s, ok := scaleNamed(name); ok {
				scale = s
			}
		}
	}
	rep := &Report{Dir: out, Manifest: *m}
	var errs []error
	all := Experiments()
	for _, rec := range m.Experiments {
		i := slices.IndexFunc(all, func(e Experiment) bool { return e.Name == rec.Name })
		if rec.Error != "" || i < 0 || len(rec.Files) == 0 { // failed, unknown, or skipped
			continue
		}
		e := all[i]
		x := &X{Scale: scale, name: e.Name, dir: out, prog: silent{}, formats: exts, loaded: map[string]*results.Table{}}
		x.params, _ = params[e.Name].(map[string]any)
		for _, f := range rec.Files {
			if strings.HasSuffix(f, ".csv") {
				t, err := results.ReadCSV(filepath.Join(dir, f))
				if err != nil {
					return nil, err
				}
				x.loaded[strings.TrimSuffix(f, ".csv")] = t
			}
		}
		if err := e.Replot(x); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", e.Name, err))
		}
		rep.Headlines = append(rep.Headlines, x.headlines...)
		rep.Claims = append(rep.Claims, x.claims...)
	}
	return rep, errors.Join(errs...)
}

// Loaded returns the table name ("" for the experiment's own) read by Replot.
func (x *X) Loaded(name string) (*results.Table, error) {
	if name == "" {
		name = x.name
	}
	t := x.loaded[name]
	if t == nil {
		return nil, fmt.Errorf("%w: no table %s", results.ErrSchema, name)
	}
	return t, nil
}

// loadedParam returns a numeric parameter the run recorded in its manifest.
func (x *X) loadedParam(name string) (float64, error) {
	v, ok := x.params[name].(float64) // JSON numbers
	if !ok {
		return 0, fmt.Errorf("%w: the manifest has no parameter %s", results.ErrSchema, name)
	}
	return v, nil
}

// replot loads table name ("" for the experiment's own) and calls report with it.
func replot(x *X, name string, report func(*results.Table) error) error {
	t, err := x.Loaded(name)
	if err != nil {
		return err
	}
	return report(t)
}

// floats returns the distinct numeric values of column c, ascending.
func floats(t *results.Table, c string) []float64 {
	var out []float64
	for _, s := range results.Distinct(t.Rows(nil), c) {
		if v, err := strconv.ParseFloat(s, 64); err == nil {
			out = append(out, v)
		}
	}
	slices.Sort(out)
	return out
}

// ints returns the distinct integer values of column c, ascending.
func ints(t *results.Table, c string) []int {
	var out []int
	for _, v := range floats(t, c) {
		out = append(out, int(v))
	}
	return out
}

// nonzero drops the zeros of vs (the runs without the varied parameter).
func nonzero(vs []int) []int {
	return slices.DeleteFunc(vs, func(v int) bool { return v == 0 })
}
