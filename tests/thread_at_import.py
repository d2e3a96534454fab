"""A module that starts a thread when imported (for the fork server's preload checks)."""

import threading

stop = threading.Event()
threading.Thread(target=stop.wait, name="started-at-import", daemon=True).start()
