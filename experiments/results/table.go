// Package results holds what an experiment run leaves behind: tidy tables written as
// CSV (one row per measurement, repetition included), read back by plots, summaries
// and tests, and the manifest that records the machine and the configuration.
package results

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"time"
)

// ErrSchema is returned for a row or a file that does not fit a table's columns.
var ErrSchema = errors.New("results: row does not fit the table's columns")

// Table is a tidy table: named columns, one row per measurement. Values are kept as
// the text the CSV holds, so a table read back equals the table written. A Table is
// not safe for concurrent use.
type Table struct {
	Name    string // the file's base name, without .csv
	Columns []string
	rows    [][]string
}

// NewTable returns an empty table with the given columns, which must be distinct
// and non-empty.
func NewTable(name string, columns ...string) (*Table, error) {
	for i, c := range columns {
		if c == "" || slices.Contains(columns[:i], c) {
			return nil, fmt.Errorf("%w: table %s: column %d %q empty or repeated", ErrSchema, name, i, c)
		}
	}
	if name == "" || len(columns) == 0 {
		return nil, fmt.Errorf("%w: a table needs a name and columns", ErrSchema)
	}
	return &Table{Name: name, Columns: slices.Clone(columns)}, nil
}

// Add appends a row, one value per column: strings, bools, integers, floats (written
// in the shortest form that reads back exactly) and durations (in nanoseconds).
func (t *Table) Add(values ...any) error {
	if len(values) != len(t.Columns) {
		return fmt.Errorf("%w: table %s: %d values for %d columns", ErrSchema, t.Name, len(values), len(t.Columns))
	}
	row := make([]string, len(values))
	for i, v := range values {
		switch v := v.(type) {
		case string:
			row[i] = v
		case bool:
			row[i] = strconv.FormatBool(v)
		case int:
			row[i] = strconv.Itoa(v)
		case int64:
			row[i] = strconv.FormatInt(v, 10)
		case uint64:
			row[i] = strconv.FormatUint(v, 10)
		case uint8:
			row[i] = strconv.Itoa(int(v))
		case float64:
			row[i] = strconv.FormatFloat(v, 'g', -1, 64)
		case time.Duration:
			row[i] = strconv.FormatInt(int64(v), 10)
		default:
			return fmt.Errorf("%w: table %s: column %s: unsupported value %T", ErrSchema, t.Name, t.Columns[i], v)
		}
	}
	t.rows = append(t.rows, row)
	return nil
}

// Len returns the number of rows.
func (t *Table) Len() int { return len(t.rows) }

// Row is one row of a table.
type Row struct {
	t      *Table
	values []string
}

// Rows returns the rows for which keep returns true (every row if keep is nil).
func (t *Table) Rows(keep func(Row) bool) []Row {
	var rs []Row
	for _, v := range t.rows {
		r := Row{t, v}
		if keep == nil || keep(r) {
			rs = append(rs, r)
		}
	}
	return rs
}

// Where returns a filter for Rows that keeps rows whose columns equal the given
// values, given as column, value pairs.
func Where(pairs ...string) func(Row) bool {
	return func(r Row) bool {
		for i := 0; i+1 < len(pairs); i += 2 {
			if r.Get(pairs[i]) != pairs[i+1] {
				return false
			}
		}
		return true
	}
}

// Get returns the row's value in column c, "" if the table has no such column.
func (r Row) Get(c string) string {
	if i := slices.Index(r.t.Columns, c); i >= 0 {
		return r.values[i]
	}
	return ""
}

// Float returns the row's value in column c as a number, NaN if it is not one.
func (r Row) Float(c string) float64 {
	f, err := strconv.ParseFloat(r.Get(c), 64)
	if err != nil {
		return math.NaN()
	}
	return f
}

// Floats returns column c of rows as numbers.
func Floats(rows []Row, c string) []float64 {
	fs := make([]float64, len(rows))
	for i, r := range rows {
		fs[i] = r.Float(c)
	}
	return fs
}

// Distinct returns the distinct values of column c in rows, in order of first
// appearance.
func Distinct(rows []Row, c string) []string {
	var vs []string
	for _, r := range rows {
		if v := r.Get(c); !slices.Contains(vs, v) {
			vs = append(vs, v)
		}
	}
	return vs
}

// WriteCSV writes the table to dir/<name>.csv and returns the file's path.
func (t *Table) WriteCSV(dir string) (string, error) {
	path := filepath.Join(dir, t.Name+".csv")
	f, err := os.Create(path)
	if err != nil {
		return "", err
	}
	w := csv.NewWriter(f)
	_ = w.Write(t.Columns) // csv.Writer keeps its first error for Flush and Error
	_ = w.WriteAll(t.rows)
	if err := errors.Join(w.Error(), f.Close()); err != nil {
		return "", fmt.Errorf("results: write %s: %w", path, err)
	}
	return path, nil
}

// ReadCSV reads a table written by WriteCSV. Every row must have the header's
// number of fields.
func ReadCSV(path string) (*Table, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }() // read-only
	r := csv.NewReader(f)
	header, err := r.Read()
	if err == io.EOF {
		return nil, fmt.Errorf("%w: %s is empty", ErrSchema, path)
	}
	if err != nil {
		return nil, fmt.Errorf("results: %s: %w", path, err)
	}
	name := filepath.Base(path)
	t, err := NewTable(name[:len(name)-len(filepath.Ext(name))], header...)
	if err != nil {
		return nil, err
	}
	if t.rows, err = r.ReadAll(); err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrSchema, path, err)
	}
	return t, nil
}
