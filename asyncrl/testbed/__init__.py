"""Several test hosts on one machine: network namespaces, links, faults."""
