package uffdfloor

import (
	"testing"

	"github.com/odpemu/odpemu/pagefault"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The floors run and give a positive cost per page.
func TestFloors(t *testing.T) {
	if p := pagefault.ProbeKernel(); p.Err != nil {
		t.Skipf("skipped: no userfaultfd: %v", p.Err)
	}
	cp, err := CopyPerPage(256)
	require.NoError(t, err)
	assert.Positive(t, cp)
	for _, spin := range []bool{false, true} {
		h, err := HandlerPerFault(256, spin)
		require.NoError(t, err)
		assert.Positive(t, h)
	}
	_, err = CopyPerPage(0)
	assert.Error(t, err)
}
