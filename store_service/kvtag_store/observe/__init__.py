"""The operator's views: metrics, history, status document/page/HTTP, reports, tenant stats and logs."""
