"""Tools around the engine, kept out of its package: the benchmarks (`radixserve bench`) and the
scheduler simulator (`radixserve simulate` / `calibrate`), with the charts they draw. They import
the engine; the engine never imports them (only its command line, which offers them)."""
