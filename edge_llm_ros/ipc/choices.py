"""The names of the buffer allocators ipc ships, best first: this module imports nothing.

allocators.py names its classes from here; bringup's parameter table offers them
(pool.allocator) without loading the allocators (fcntl, ioctls).
"""

DMA_HEAP = 'dma_heap'
UDMABUF = 'udmabuf'
MEMFD = 'memfd'
# The order select_allocator('auto') tries them (the classes' priorities).
ALLOCATORS = (DMA_HEAP, UDMABUF, MEMFD)
