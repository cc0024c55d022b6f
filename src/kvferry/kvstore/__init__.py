"""The node's KV store: blocks below the device pool (host DRAM, SSD, a
remote tier), shared by every engine process on the node."""
