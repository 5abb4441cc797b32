package odp

import "strings"

// Access is a memory region's access flags, with ibv_access_flags' values.
type Access uint32

// The access flags.
const (
	AccessLocalWrite   Access = 1 << 0
	AccessRemoteWrite  Access = 1 << 1
	AccessRemoteRead   Access = 1 << 2
	AccessRemoteAtomic Access = 1 << 3
	// AccessMWBind lets memory windows be bound to the MR (IBV_ACCESS_MW_BIND).
	AccessMWBind Access = 1 << 4
	// AccessOnDemand registers without pinning: pages are faulted in when the NIC
	// first touches them (IBV_ACCESS_ON_DEMAND).
	AccessOnDemand Access = 1 << 6

	accessKnown = AccessLocalWrite | AccessRemoteWrite | AccessRemoteRead | AccessRemoteAtomic | AccessMWBind |
		AccessOnDemand
)

// String lists the flags as verbs names them.
func (a Access) String() string {
	var s []string
	for _, f := range []struct {
		bit  Access
		name string
	}{{AccessLocalWrite, "LOCAL_WRITE"}, {AccessRemoteWrite, "REMOTE_WRITE"}, {AccessRemoteRead, "REMOTE_READ"},
		{AccessRemoteAtomic, "REMOTE_ATOMIC"}, {AccessMWBind, "MW_BIND"}, {AccessOnDemand, "ON_DEMAND"}} {
		if a&f.bit != 0 {
			s = append(s, f.name)
		}
	}
	if len(s) == 0 {
		return "LOCAL_READ"
	}
	return strings.Join(s, "|")
}

// writable reports whether the NIC may write the region through some access.
// check refuses what no registration may ask for: unknown flags, remote write or
// atomic access without LOCAL_WRITE (ib_check_mr_access).
func (a Access) check() error {
	switch {
	case a&^accessKnown != 0:
		return wrap(ErrInvalidArgument, "unknown access flags %#x", uint32(a&^accessKnown))
	case a&(AccessRemoteWrite|AccessRemoteAtomic) != 0 && a&AccessLocalWrite == 0:
		return wrap(ErrInvalidArgument, "%v needs LOCAL_WRITE", a)
	}
	return nil
}

func (a Access) writable() bool {
	return a&(AccessLocalWrite|AccessRemoteWrite|AccessRemoteAtomic) != 0
}
