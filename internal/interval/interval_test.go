package interval

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestUncovered(t *testing.T) {
	r := Range{100, 200}
	tests := []struct {
		name   string
		others []Range
		want   []Range
	}{
		{"none", nil, []Range{{100, 200}}},
		{"disjoint", []Range{{0, 100}, {200, 300}}, []Range{{100, 200}}},
		{"all", []Range{{50, 250}}, nil},
		{"middle", []Range{{120, 130}}, []Range{{100, 120}, {130, 200}}},
		{"overlapping unsorted", []Range{{150, 210}, {90, 110}, {105, 140}}, []Range{{140, 150}}},
		{"edges", []Range{{100, 101}, {199, 200}}, []Range{{101, 199}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, Uncovered(r, tc.others))
		})
	}
	assert.True(t, Range{5, 5}.Empty())
}

func TestOverlapsAndIntersect(t *testing.T) {
	r := Range{100, 200}
	tests := []struct {
		o       Range
		overlap bool
		common  Range
	}{
		{Range{0, 100}, false, Range{}},   // touching below: half-open
		{Range{200, 300}, false, Range{}}, // touching above
		{Range{99, 101}, true, Range{100, 101}},
		{Range{199, 250}, true, Range{199, 200}},
		{Range{120, 130}, true, Range{120, 130}},
		{Range{0, 1000}, true, Range{100, 200}},
		{Range{150, 150}, false, Range{}}, // empty
	}
	for _, tc := range tests {
		assert.Equal(t, tc.overlap, r.Overlaps(tc.o), "%v overlaps %v", r, tc.o)
		assert.Equal(t, tc.overlap, tc.o.Overlaps(r), "%v overlaps %v", tc.o, r)
		got := r.Intersect(tc.o)
		assert.Equal(t, !tc.overlap, got.Empty(), "%v ∩ %v = %v", r, tc.o, got)
		if tc.overlap {
			assert.Equal(t, tc.common, got)
		}
	}
	assert.Equal(t, r, r.Span())
}

func TestMerge(t *testing.T) {
	assert.Empty(t, Merge(nil))
	assert.Equal(t, []Range{{0, 30}, {40, 50}},
		Merge([]Range{{40, 50}, {10, 20}, {20, 30}, {0, 15}, {45, 45}, {42, 44}}), "touching, overlapping, empty, inside")
	assert.Equal(t, []Range{{1, 2}, {3, 4}}, Merge([]Range{{3, 4}, {1, 2}}), "apart")
}

func TestSubtract(t *testing.T) {
	rs := []Range{{0, 10}, {20, 30}, {40, 50}}
	assert.Equal(t, []Range{{0, 10}, {20, 25}, {28, 30}, {40, 50}}, Subtract(rs, Range{25, 28}), "inside one")
	assert.Equal(t, []Range{{0, 5}, {45, 50}}, Subtract(rs, Range{5, 45}), "across several")
	assert.Equal(t, rs, Subtract(rs, Range{10, 20}), "between")
	assert.Empty(t, Subtract(rs, Range{0, 50}))
}
