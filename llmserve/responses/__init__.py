"""The Responses API (`/v1/responses`) on the chat path: items and requests (items.py), the runs and
their events (service.py), stored responses (storage.py picks: store.py's SQLite file or pg_store.py's
Postgres database). docs/responses.md."""
