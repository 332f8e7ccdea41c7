"""`tandem serve`: the OpenAI-compatible HTTP server over one Engine (app.py routes, queue.py the
engine-sharing queue, limits.py errors and limits, schemas.py request bodies, launch.py child processes)."""
