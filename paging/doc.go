// Package paging changes the translations under ODP memory regions the way the
// kernel's reclaim, swap and migration do: a Pager evicts pages of paged regions to a
// Store (a memfd or a file) and migrates pages to new frames, each change inside an
// invalidation (package invalidate), so the NIC drops its entries and drains its DMA
// first. Under a resident budget it reclaims in the background (kswapd's role) and
// directly from the NIC's fault path; the CPU fault server (package pagefault)
// reclaims directly before it installs past the budget. The page states the pager and
// the server share, and who changes which, are in pagefault's package doc.
//
// # Lock order
//
//	Pager.reclaimMu   one evictor of the pager's at a time (Exclusive runs a
//	                  caller's change under it)
//	invalidate.Registry.mu
//	                  taken inside, by each eviction's or migration's invalidation
//	Pager.rmu         the region list; held only for lookups, never across a call out
//	the server's DMA gate (pagefault.Gate)
//	                  entered as a DMA by held, around one ioctl that puts content
//	                  back into place; nothing is taken inside it
//	the server's store lock (C, pagefault)
//	                  taken by PagedRegion.StoreEvicted, Unstore and
//	                  PunchUnlessStored: the pager's store writes and punches order
//	                  with the server's direct reclaim under it
//
// Functions named ...Locked need reclaimMu.
package paging
