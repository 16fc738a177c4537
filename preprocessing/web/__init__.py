"""Web data: warc.py (WARC/WET reader), warc_stage.py (the `warc` stage), url_filter.py (the `url_filter` pass)."""
