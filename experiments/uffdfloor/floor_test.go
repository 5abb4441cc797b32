package uffdfloor

import (
	"testing"

	"github.com/odpemu/odpemu/pagefault"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Both floors run and give a positive cost per page; a fault served by a handler
// costs at least the copy it makes.
func TestFloors(t *testing.T) {
	if p := pagefault.ProbeKernel(); p.Err != nil {
		t.Skipf("skipped: no userfaultfd: %v", p.Err)
	}
	cp, err := CopyPerPage(256)
	require.NoError(t, err)
	assert.Positive(t, cp)
	h, err := HandlerPerFault(256)
	require.NoError(t, err)
	assert.Positive(t, h)
	_, err = CopyPerPage(0)
	assert.Error(t, err)
}
