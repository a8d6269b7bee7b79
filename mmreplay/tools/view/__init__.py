"""`mmreplay view STORE`: a read-only local web viewer for a store.

`server.py` serves the page (``static/``: plain HTML, JS and CSS, no build step, nothing
fetched from the internet) and JSON, image and video endpoints; `data.py` follows the store
across generations and caches per generation; `follow.py` tells it cheaply when a writer
committed (a directory or a bucket URL); `health.py` runs verify on demand, bounded;
`tables.py` turns inspection results into JSON.
"""

from mmreplay.tools.view.server import ViewerServer, make_server

__all__ = ["ViewerServer", "make_server"]
