// Calls to the API with the key, and server-sent events read from a streamed response body.
// The key lives in this tab's sessionStorage and travels only in the Authorization header.

const KEY_STORAGE = "tokenmill-api-key";

export class Api {
  constructor() {
    this.key = sessionStorage.getItem(KEY_STORAGE) || "";
    this.onUnauthorized = () => {};
  }

  headers(extra = {}) {
    const headers = { ...extra };
    if (this.key) headers["Authorization"] = `Bearer ${this.key}`;
    return headers;
  }

  setKey(key) {
    this.key = key;
    sessionStorage.setItem(KEY_STORAGE, key);
  }

  // fetch() with the key; a 401 asks for the key (and rejects this call)
  async fetch(path, options = {}) {
    const response = await fetch(path, { ...options, headers: this.headers(options.headers || {}),
                                         cache: "no-store", credentials: "omit" });
    if (response.status === 401) {
      this.onUnauthorized();
      throw new ApiError(401, "the API key is missing or wrong");
    }
    return response;
  }

  async json(path, body, options = {}) {
    const response = await this.fetch(path, { method: body === undefined ? "GET" : "POST",
      headers: { "Content-Type": "application/json" },
      body: body === undefined ? undefined : JSON.stringify(body), ...options });
    if (!response.ok) throw await ApiError.from(response);
    return response.json();
  }
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }

  static async from(response) {
    let message = `HTTP ${response.status}`;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (_) { /* not JSON */ }
    return new ApiError(response.status, message);
  }
}

// Server-sent events of a streamed response body: calls onEvent(parsed JSON or "[DONE]") per event.
export async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder("utf-8");  // {stream: true} keeps a character split over two reads whole
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data) onEvent(data === "[DONE]" ? data : JSON.parse(data));
    }
  }
}
