"""One file per parallel dimension; each wrapper is handed the process group it uses."""
