"""The build: manifests, the doit task graph, stage functions, paths, atomic writes."""
