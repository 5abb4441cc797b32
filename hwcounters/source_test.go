package hwcounters_test

import (
	"github.com/odpemu/odpemu/hwcounters"
	"github.com/odpemu/odpemu/odp"
)

// An odp.Device is a Source as it is: hwcounters.Mount(dir, dev).
var _ hwcounters.Source = (*odp.Device)(nil)
