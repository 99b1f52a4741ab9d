"""Registry: the index DB, refs (names, tags, pins), gc, verify, copies between stores."""
