package inbox

// PurgeRetryable is purgeRetryable, for the external tests.
var PurgeRetryable = purgeRetryable
