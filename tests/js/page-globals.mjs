// Loads what index.html loads as classic scripts (the vendored protobufjs runtime and the
// generated chunk_pb.js) into Node's global scope, as the browser does.

import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { runInThisContext } from "node:vm";

const require = createRequire(import.meta.url);
const STATIC = new URL("../../cosyvoice/static/", import.meta.url);

globalThis.protobuf = require(new URL("vendor/protobuf.min.js", STATIC).pathname);
runInThisContext(readFileSync(new URL("chunk_pb.js", STATIC), "utf8"));
