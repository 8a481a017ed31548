// The playground: a chat (or raw completion) streamed from the OpenAI-compatible API, with a Stop
// button that aborts the request (the server frees its KV blocks when the connection closes).
import { ApiError, readEvents } from "./api.js";
import { element } from "./dom.js";
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);

export class Playground {
  constructor(api) {
    this.api = api;
    this.messages = [];  // the conversation so far: {role, content}
    this.controller = null;
    $("pg-send").addEventListener("click", () => this.send());
    $("pg-stop-button").addEventListener("click", () => this.stop());
    $("pg-clear").addEventListener("click", () => this.clear());
    $("pg-mode").addEventListener("change", () => this.clear());
    $("pg-input").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey) {
        event.preventDefault();
        this.send();
      }
    });
  }

  params() {
    const body = { temperature: Number($("pg-temperature").value), top_p: Number($("pg-top-p").value),
                   max_tokens: Number($("pg-max-tokens").value) };
    if ($("pg-seed").value !== "") body.seed = Number($("pg-seed").value);
    const stop = $("pg-stop").value.split("\n").filter((s) => s.length);
    if (stop.length) body.stop = stop;
    return body;
  }

  clear() {
    this.stop();
    this.messages = [];
    $("pg-messages").replaceChildren();
    $("pg-error").hidden = true;
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  bubble(role, text) {
    const node = element("div", `message ${role}`);
    node.append(element("div", "role", role === "user" ? "You" : role === "assistant" ? "Model" : "Prompt"));
    const content = element("div", "content");
    if (role === "assistant") renderMarkdown(content, text);
    else content.textContent = text;
    node.append(content);
    $("pg-messages").append(node);
    return node;
  }

  async send() {
    const text = $("pg-input").value;
    if (this.controller || !text.trim()) return;
    $("pg-input").value = "";
    $("pg-error").hidden = true;
    const chat = $("pg-mode").value === "chat";
    let path, body;
    if (chat) {
      this.messages.push({ role: "user", content: text });
      this.bubble("user", text);
      const system = $("pg-system").value.trim();
      const messages = system ? [{ role: "system", content: system }, ...this.messages] : this.messages;
      path = "/v1/chat/completions";
      body = { messages, ...this.params() };
    } else {
      $("pg-messages").replaceChildren();
      this.bubble("prompt", text);
      path = "/v1/completions";
      body = { prompt: text, ...this.params() };
    }
    body.stream = true;
    body.stream_options = { include_usage: true };
    const reply = this.bubble(chat ? "assistant" : "completion", "");
    reply.classList.add("streaming");
    const content = reply.querySelector(".content");
    const stats = element("div", "reply-stats", "waiting for the first token…");
    reply.append(stats);
    this.controller = new AbortController();
    $("pg-send").disabled = true;
    $("pg-stop-button").disabled = false;
    const started = performance.now();
    let first = null, last = null, output = "", usage = null, deltas = 0, finish = null, stopped = false;
    try {
      const response = await this.api.fetch(path, { method: "POST", headers: { "Content-Type": "application/json" },
                                                    body: JSON.stringify(body), signal: this.controller.signal });
      if (!response.ok) throw await ApiError.from(response);
      await readEvents(response, (event) => {
        if (event === "[DONE]") return;
        if (event.error) throw new ApiError(event.error.code || 500, event.error.message);
        if (event.usage) usage = event.usage;
        if (event.id) reply.dataset.id = event.id;
        for (const choice of event.choices || []) {
          const piece = chat ? (choice.delta && choice.delta.content) || "" : choice.text || "";
          if (piece) {
            const now = performance.now();
            if (first === null) first = now;
            last = now;
            deltas += 1;
            output += piece;
            if (chat) renderMarkdown(content, output);
            else content.textContent = output;
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      });
    } catch (error) {
      if (error.name === "AbortError") stopped = true;
      else {
        $("pg-error").textContent = error.message;
        $("pg-error").hidden = false;
      }
    } finally {
      this.controller = null;
      $("pg-send").disabled = false;
      $("pg-stop-button").disabled = true;
      reply.classList.remove("streaming");
    }
    if (chat && output) this.messages.push({ role: "assistant", content: output });
    this.showStats(stats, { started, first, last, usage, deltas, finish: stopped ? "stopped" : finish });
  }

  showStats(node, { started, first, last, usage, deltas, finish }) {
    const ttft = first === null ? null : (first - started) / 1000;
    const completion = usage ? usage.completion_tokens : deltas;
    const tps = first !== null && last > first && completion > 1 ? (completion - 1) / ((last - first) / 1000) : null;
    node.dataset.ttft = ttft === null ? "" : String(ttft);
    node.dataset.tokensPerSecond = tps === null ? "" : String(tps);
    node.dataset.promptTokens = usage ? String(usage.prompt_tokens) : "";
    node.dataset.completionTokens = String(completion);
    node.dataset.finish = finish || "";
    const parts = [];
    if (ttft !== null) parts.push(`TTFT ${(1000 * ttft).toFixed(0)} ms`);
    if (tps !== null) parts.push(`${tps.toFixed(1)} tok/s`);
    if (usage) parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
    else parts.push(`${completion} chunks`);
    if (finish) parts.push(finish);
    node.textContent = parts.join(" · ");
  }
}
