// Package invalidate will hold odpemu's MMU-notifier-like invalidation: userfaultfd
// REMOVE, UNMAP and REMAP events turned into NIC page table invalidations, the
// emulator's own eviction to a backing store under a resident budget, page migration,
// and the DMA audit that detects copies through stale translations.
//
// The mechanisms it builds on exist already: the CPU fault server queues every
// non-pagefault event for Go (pagefault.CPUServer.Events), and mmu.Table.Invalidate
// clears entries and waits for DMA that started before it. Dereg uses that path today.
package invalidate
