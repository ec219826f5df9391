"""The Responses API (`/v1/responses`) on the chat path: items and requests (items.py), the runs and
their events (service.py), stored responses (store.py). docs/responses.md."""
