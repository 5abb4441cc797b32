package odp

// ODPGeneralCaps are ibv_odp_general_caps' bits.
type ODPGeneralCaps uint64

const (
	// ODPSupport: AccessOnDemand registrations work.
	ODPSupport ODPGeneralCaps = 1 << 0
	// ODPSupportImplicit: an MR can cover the whole address space (RegImplicitMR).
	ODPSupportImplicit ODPGeneralCaps = 1 << 1
)

// ODPTransportCaps are ibv_odp_transport_cap_bits: which operations of a transport
// may use ODP memory.
type ODPTransportCaps uint32

// The operations ODP memory can serve.
const (
	ODPSend    ODPTransportCaps = 1 << 0
	ODPRecv    ODPTransportCaps = 1 << 1
	ODPWrite   ODPTransportCaps = 1 << 2
	ODPRead    ODPTransportCaps = 1 << 3
	ODPAtomic  ODPTransportCaps = 1 << 4
	ODPSRQRecv ODPTransportCaps = 1 << 5
)

// ODPCaps is ibv_odp_caps: what the device's ODP supports (RC, UC and UD exist here).
type ODPCaps struct {
	General ODPGeneralCaps
	RC      ODPTransportCaps
	UC, UD  ODPTransportCaps
}

// AtomicCap is ibv_atomic_cap.
type AtomicCap int

// The atomicity guarantees.
const (
	AtomicNone AtomicCap = 0
	AtomicHCA  AtomicCap = 1 // atomic among the device's own atomics
	AtomicGlob AtomicCap = 2 // atomic with the CPU's atomics too
)

// DeviceAttr is what QueryDevice reports, after ibv_query_device_ex.
type DeviceAttr struct {
	Name          string
	PageSize      int    // the size of the pages the NIC's tables map
	MaxMRSize     uint64 // the largest MR
	MaxMsgSize    uint64 // the largest RC message
	MaxQPWR       int    // work requests per queue
	MaxSGE        int    // SGEs per work request
	MaxInlineData int    // inline bytes per work request
	MaxCQE        int    // completions per CQ
	// MaxQPRdAtom is how many READs and atomics a QP keeps as a responder for their
	// duplicates (max_qp_rd_atom); MaxQPInitRdAtom how many it has outstanding as a
	// requester (max_qp_init_rd_atom): the most QPAttr.MaxDestRdAtomic and
	// MaxRdAtomic may ask for, and what a new QP uses.
	MaxQPRdAtom, MaxQPInitRdAtom int
	// MaxSRQWR and MaxSRQSGE bound an SRQ's receives and their SGEs; SRQs are
	// bounded by memory only.
	MaxSRQWR, MaxSRQSGE int
	AtomicCap           AtomicCap
	ODP                 ODPCaps
	// ResponderFaults is how a responder answers a request whose ODP pages are
	// missing (the device's Config).
	ResponderFaults FaultPolicy
}

// maxCQE bounds a CQ's depth.
const maxCQE = 1 << 22

// maxMRSize is the largest MR: the user half of x86-64's 47-bit address space.
const maxMRSize = 1 << 47

// maxMsg is the largest RC message (2 GiB), as on mlx5.
const maxMsg = 1 << 31

// The QP limits QueryDevice reports.
const (
	maxQPWR   = 1 << 15 // work requests per queue
	maxSGE    = 32      // SGEs per work request
	maxInline = 1024    // bytes of inline data per work request
)
