// Package interval computes which parts of an address range no other live range
// covers: what may be unregistered or munlocked when one of several overlapping
// registrations goes away (userfaultfd registrations and mlock do not nest).
package interval

import "sort"

// Range is the half-open address range [Start, End).
type Range struct{ Start, End uintptr }

// Empty reports whether r holds no address.
func (r Range) Empty() bool { return r.End <= r.Start }

// Span returns r: types that embed a Range show it through Span.
func (r Range) Span() Range { return r }

// Overlaps reports whether r and o share an address.
func (r Range) Overlaps(o Range) bool {
	return o.Start < r.End && r.Start < o.End && !r.Empty() && !o.Empty()
}

// Intersect returns the addresses r and o share (Empty if none).
func (r Range) Intersect(o Range) Range { return Range{max(r.Start, o.Start), min(r.End, o.End)} }

// Uncovered returns the parts of r that no range in others covers, in address order.
func Uncovered(r Range, others []Range) []Range {
	var cov []Range
	for _, o := range others {
		if r.Overlaps(o) {
			cov = append(cov, o)
		}
	}
	sort.Slice(cov, func(i, j int) bool { return cov[i].Start < cov[j].Start })
	var out []Range
	pos := r.Start
	for _, c := range cov {
		if c.Start > pos {
			out = append(out, Range{pos, min(c.Start, r.End)})
		}
		pos = max(pos, c.End)
		if pos >= r.End {
			return out
		}
	}
	if pos < r.End {
		out = append(out, Range{pos, r.End})
	}
	return out
}

// Merge returns rs sorted by start with overlapping and touching ranges joined and
// empty ones dropped; it reuses rs's array.
func Merge(rs []Range) []Range {
	sort.Slice(rs, func(i, j int) bool { return rs[i].Start < rs[j].Start })
	out := rs[:0]
	for _, r := range rs {
		switch {
		case r.Empty():
		case len(out) > 0 && r.Start <= out[len(out)-1].End:
			out[len(out)-1].End = max(out[len(out)-1].End, r.End)
		default:
			out = append(out, r)
		}
	}
	return out
}

// Subtract returns the parts of the ranges rs that x does not cover, in their order.
func Subtract(rs []Range, x Range) []Range {
	var out []Range
	for _, r := range rs {
		if !r.Overlaps(x) {
			out = append(out, r)
			continue
		}
		out = append(out, Uncovered(r, []Range{x})...)
	}
	return out
}
