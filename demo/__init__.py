"""The gpu-slicer demo (`make demo`, `python -m demo` from a checkout's root).

Not part of the product: nothing in proto/, slicer/, launcher/ or dispatcher/ imports it
(`slicerctl demo` runs it as `python -m demo`). `demo.main` parses the options and runs
one of the two modes (`demo.loop`: the whole train / publish / sample loop; trainer stubs
taking turns); `demo.proc` starts and always ends the processes; `demo.report` and
`demo.loop_report` build the text and JSON reports, `demo.chart` the PNG timeline
(matplotlib, the `charts` extra)."""
