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
