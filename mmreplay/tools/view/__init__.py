"""`mmreplay view STORE`: a read-only local web viewer for a store.

`server.py` serves the page (``static/``: plain HTML, JS and CSS, no build step, nothing
fetched from the internet) and JSON and image endpoints; `data.py` follows the store across
generations and caches per generation; `tables.py` turns inspection results into JSON.
"""

from mmreplay.tools.view.server import ViewerServer, make_server

__all__ = ["ViewerServer", "make_server"]
